#!/usr/bin/env bash
# gpu_issue30_carry.sh - everything issue 30's GPU run needs besides the vLLM kit, packed into
# carry-sized parts, and the complete, ordered list of device calls.
#
# The GPU machine (Python 3.12, torch 2.11.0+cu130, transformers 5.17, no network) lacks vLLM,
# Ray, DeepSpeed, TRL and datasets. ../shared/gpu-vllm/prepare.sh brings vLLM 0.26.0 (with
# msgspec, dill, pydantic, jsonschema) in parts of <= 60 MiB; this script adds, as cp312 wheels
# pinned by sha256:
#   ray 2.60.0 (without ray/jars/ray_dist.jar: Ray's Java worker, 32 MiB that a Python-only Ray
#     never reads; Ray checks for the folder and starts no Java worker without it),
#   deepspeed 0.19.8 (DeepSpeed publishes only an sdist: pinned by its hash, built here into a
#     pure-Python wheel with no ops prebuilt; on the GPU its CUDA ops build just in time),
#   trl 1.16.0 (the bench env's pin), datasets 5.2.0 + multiprocess 0.70.19 + fsspec 2026.9.0
#     (datasets allows <= 2026.9.0), hjson 3.1.0 (DeepSpeed),
# the arithmetic preset's seed-0 build (2.5 MiB, so that the GPU run does not repeat its SFT), and
# a copy of gpu_issue30.sh + grpo_vs_trl.py (used only if the checkout that travels lacks them).
#
# Run from the root of the checkout the device tool sends, after the vLLM kit is prepared there:
#   LEAN=1 bash ../shared/gpu-vllm/prepare.sh && bash <this worktree>/benchmarks/gpu_issue30_carry.sh
# Writes .vllm-carry/extraNN/ (the first one is sized to ride along with the last vLLM part) and
# .vllm-carry/calls_all.txt (every call in order: command, carry, timeout). Env: PYTHON (default
# python3), PRESET (the preset folder to carry; default the seed-0 build under ~/.cache).
set -euo pipefail

PY=${PYTHON:-python3}
CARRY=.vllm-carry
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PRESET=${PRESET:-$HOME/.cache/rl-launch/presets/arithmetic-6f462b5615e0466d}
LIMIT=$((64 * 1048576))
MARGIN=$((1048576 + 262144)) # 1 MiB like prepare.sh, + 256 KiB for files the checkout may gain before the calls

top=$(git rev-parse --show-toplevel 2>/dev/null) || { echo "not inside a git repository" >&2; exit 1; }
[ "$(cd "$top" && pwd -P)" = "$(pwd -P)" ] || { echo "run me from the repository root: $top" >&2; exit 1; }
[ -s "$CARRY/calls.txt" ] && [ -s "$CARRY/wheels.list" ] || {
  echo "$CARRY/calls.txt missing: run LEAN=1 bash ../shared/gpu-vllm/prepare.sh first" >&2; exit 1; }
git check-ignore -q "$CARRY/x" || { echo "$CARRY is not ignored by git" >&2; exit 1; }
[ -f "$PRESET/preset_build.json" ] || { echo "no finished preset build in $PRESET (PRESET=...)" >&2; exit 1; }
N=$(ls -d "$CARRY"/part[0-9]* | wc -l)
lastv=$(printf 'part%02d' "$N")
[ -s "$CARRY/$lastv/SHA256" ] || { echo "$CARRY/$lastv/SHA256 missing: the vLLM kit is incomplete" >&2; exit 1; }

# 1. the wheels
X=$CARRY/extra-wheels
rm -rf "$X" "$CARRY"/extra[0-9]* "$CARRY/.xsplit"
mkdir -p "$X/dl" "$X/sdist" "$X/final"
cat > "$X/requirements.txt" <<'EOF'
ray==2.60.0 --hash=sha256:b951b40965947a63615830916be04f26440d234de1e9a29dbf2155d03fa9ad2a
trl==1.16.0 --hash=sha256:c4726e139dd40e1a41661511c639c8a68416782b2e3e8c0befebd77bb7ba0396
datasets==5.2.0 --hash=sha256:4be9e2882caaf5db13eadc39e93f3da2a995187b99acebac1595bf6c58dfa927
multiprocess==0.70.19 --hash=sha256:3a56c0e85dd5025161bac5ce138dcac1e49174c7d8e74596537e729fd5c53c28
fsspec==2026.9.0 --hash=sha256:8dd6e646e99ea382bd85f97a45e6b526a442d79423a7dc673f1e2756d05fcb5f
hjson==3.1.0 --hash=sha256:65713cdcf13214fb554eb8b4ef803419733f4f5e551047c9b711098ab7186b89
EOF
echo 'deepspeed==0.19.8 --hash=sha256:9e491abd0827ea5c389dd702e15e11e13d83d904bac4a20d6c2a4cb37207a9af' \
  > "$X/requirements-sdist.txt"
plat=""
for p in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux2014 manylinux1; do
  plat="$plat --platform ${p}_x86_64"
done
# shellcheck disable=SC2086
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $plat --require-hashes -d "$X/dl" -r "$X/requirements.txt"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary=:all: --require-hashes \
  -d "$X/sdist" -r "$X/requirements-sdist.txt"
# DeepSpeed's wheel: pure Python (py3-none-any), no op prebuilt (DS_BUILD_OPS=0 is its default)
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$X/dl" "$X"/sdist/deepspeed-0.19.8.tar.gz
ls "$X"/dl/deepspeed-0.19.8-py3-none-any.whl > /dev/null

# Ray without its Java jar (and without the jar's line in RECORD, so the wheel stays consistent)
"$PY" - "$X/dl" "$X/final" <<'EOF'
import pathlib, shutil, sys, zipfile
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for wheel in sorted(src.glob("*.whl")):
    if not wheel.name.startswith("ray-"):
        shutil.copy2(wheel, dst / wheel.name)
        continue
    dropped = 0
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(dst / wheel.name, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename.startswith("ray/jars/"):
                dropped += info.file_size
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(l for l in data.splitlines(keepends=True) if not l.startswith(b"ray/jars/"))
            zout.writestr(info, data)
    print(f"{wheel.name}: left out ray/jars ({dropped / 2**20:.1f} MiB unpacked)")
EOF

# one version of each distribution, none already in the vLLM kit
"$PY" - "$X/final" "$CARRY/wheels.list" <<'EOF'
import pathlib, re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
extra = [f.name for f in pathlib.Path(sys.argv[1]).glob("*.whl")]
kit = pathlib.Path(sys.argv[2]).read_text().split()
names = [norm(n.split("-")[0]) for n in extra]
dup = sorted({n for n in names if names.count(n) > 1} | (set(names) & {norm(n.split("-")[0]) for n in kit}))
if dup:
    sys.exit("two versions of: " + " ".join(dup))
print(f"{len(extra)} extra wheels, none in the vLLM kit")
EOF
(cd "$X/final" && ls *.whl) > "$X/wheels.list"

# 2. the tar stream: wheels, the preset build, the fallback copies of the GPU script and benchmark
S=$X/stage
mkdir -p "$S/wheels" "$S/presets" "$S/gpukit"
cp "$X"/final/*.whl "$S/wheels/"
cp -r "$PRESET" "$S/presets/"
cp "$HERE/gpu_issue30.sh" "$HERE/grpo_vs_trl.py" "$S/gpukit/"
tar -cf "$X/extra.tar" -C "$S" wheels presets gpukit
xsha=$(sha256sum "$X/extra.tar" | cut -d' ' -f1)
xbytes=$(stat -c %s "$X/extra.tar")

# 3. how much room each call has: 64 MiB less what the checkout sends (as prepare.sh counts it)
repo=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | awk '{s+=$1} END{print s+0}')
if [ -d shared ] && git check-ignore -q shared; then repo=$((repo + $(du -sb shared | cut -f1))); fi
room=$((LIMIT - repo - MARGIN - 65536)) # 64 KiB for the install script
lastbytes=$(du -sb "$CARRY/$lastv" | cut -f1)
first=$((room - lastbytes))
[ "$first" -ge 1048576 ] || first=0 # too little room beside the last vLLM part: the extras start a call of their own
mkdir -p "$CARRY/.xsplit"
if [ "$first" -gt 0 ]; then
  head -c "$first" "$X/extra.tar" > "$CARRY/.xsplit/c000"
  tail -c +$((first + 1)) "$X/extra.tar" | split -b "$room" -d -a 3 - "$CARRY/.xsplit/d"
else
  split -b "$room" -d -a 3 "$X/extra.tar" "$CARRY/.xsplit/d"
fi
M=0
for c in "$CARRY"/.xsplit/*; do
  [ -s "$c" ] || continue
  M=$((M + 1)); p=$(printf '%s/extra%02d' "$CARRY" "$M")
  mkdir -p "$p"; mv "$c" "$p/chunk"
done
rm -rf "$CARRY/.xsplit"
lastx=$(printf 'extra%02d' "$M")
[ "$(cat "$CARRY"/extra[0-9]*/chunk | sha256sum | cut -d' ' -f1)" = "$xsha" ] || { echo "extra split check failed" >&2; exit 1; }
echo "$xsha  /tmp/extra.tar" > "$CARRY/$lastx/SHA256"

# 4. the install script, run by the last transfer
parts=""
for k in $(seq 1 "$N"); do parts="$parts $(printf 'part%02d' "$k")"; done
xparts=""
for k in $(seq 1 "$M"); do xparts="$xparts $(printf 'extra%02d' "$k")"; done
cat > "$CARRY/$lastx/install.sh" <<EOF
#!/usr/bin/env bash
# Last transfer of issue 30's GPU kit: check that every part arrived, join and check the vLLM kit
# and the extras, install all wheels into /tmp/site (no index, no deps), unpack the preset build
# and the fallback scripts into /tmp/gpukit, and import everything once.
set -u
C=.vllm-carry
m=0
for p in$parts$xparts; do [ -s \$C/\$p/chunk ] || { echo "MISSING \$C/\$p/chunk"; m=1; }; done
du -sh \$C
[ \$m = 0 ] || { echo "RESTART FROM part01: this machine lacks earlier parts"; exit 3; }
set -e
t0=\$(date +%s)
rm -rf /tmp/site /tmp/whl /tmp/gpukit; mkdir -p /tmp/whl /tmp/gpukit
cat$(for p in $parts; do printf ' $C/%s/chunk' "$p"; done) > /tmp/vllm-wheels.tar
sha256sum -c \$C/$lastv/SHA256
tar -xf /tmp/vllm-wheels.tar -C /tmp/whl; rm /tmp/vllm-wheels.tar
cat$(for p in $xparts; do printf ' $C/%s/chunk' "$p"; done) > /tmp/extra.tar
sha256sum -c \$C/$lastx/SHA256
tar -xf /tmp/extra.tar -C /tmp/gpukit; rm /tmp/extra.tar
echo "joined and checked in \$(( \$(date +%s) - t0 )) s: \$(ls /tmp/whl | wc -l) vLLM-kit wheels, \$(ls /tmp/gpukit/wheels | wc -l) extra"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/whl/*.whl /tmp/gpukit/wheels/*.whl
rm -rf /tmp/whl /tmp/gpukit/wheels
echo "installed into /tmp/site in \$(( \$(date +%s) - t0 )) s (\$(du -sh /tmp/site | cut -f1))"
# bytecode now, as a pip install without --target would have written it: otherwise the first run
# of each side compiles every module it imports (the driver's 19 s before its first line)
python3 -m compileall -q -j 0 /tmp/site > /tmp/compileall.log 2>&1 || true
echo "compiled to bytecode in \$(( \$(date +%s) - t0 )) s (\$(grep -c . /tmp/compileall.log) lines of complaints)"
export PYTHONPATH=/tmp/site
python3 -m pip --version
python3 -m pip list 2>/dev/null | grep -i -E '^(torch|transformers|accelerate|peft|fsspec|pyarrow|packaging|huggingface.hub|pytest|pytest-xdist|numpy|pydantic|yarl|protobuf|ninja) ' || true
python3 -c "
import time; t = time.time()
import torch, vllm, ray, deepspeed, trl, datasets, msgspec, transformers
print('imports ok in %.1f s:' % (time.time() - t), 'torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO GPU', '| vllm', vllm.__version__,
      '| ray', ray.__version__, '| deepspeed', deepspeed.__version__, '| trl', trl.__version__,
      '| datasets', datasets.__version__, '| msgspec', msgspec.__version__, '| transformers', transformers.__version__)
"
echo "KIT READY in \$(( \$(date +%s) - t0 )) s"
# No FusedAdam prebuild (since 2026-11-27): a ZeRO-0/1/2 learner on CUDA takes torch's fused
# AdamW (rl_learner.build_optimizer), so the long workload runs as on a fresh machine; the gpu
# tests that need FusedAdam (ZeRO-3) build it in gpu_issue30.sh's warm step
EOF
chmod +x "$CARRY/$lastx/install.sh"

# 5. sizes: every call's carry + the checkout must fit 64 MiB
sz() { du -sb "$@" | awk '{s+=$1} END{print s+0}'; }
mib() { awk -v b="$1" 'BEGIN{printf "%.2f MiB", b/1048576}'; }
check() { # $1 = the parts this call carries; $2.. = the parts that must be there already. A
  # call's carry replaces the last call's carried paths inside the checkout: each part is moved
  # out to /tmp/kit (kept while the machine is), and the install call moves them back.
  local mine=$1; shift
  printf 'mkdir -p /tmp/kit && mv %s /tmp/kit/; m=0; for p in %s; do [ -s /tmp/kit/$p/chunk ] || { echo MISSING /tmp/kit/$p/chunk; m=1; }; done; du -sh /tmp/kit; [ $m = 0 ] || { echo "RESTART FROM part01: this machine lacks earlier parts"; exit 3; }' "$mine" "$*"
}
script='if [ -f benchmarks/gpu_issue30.sh ]; then bash benchmarks/gpu_issue30.sh; else bash /tmp/gpukit/gpukit/gpu_issue30.sh; fi'
calls=()
carries=()
timeouts=()
have=()
for k in $(seq 1 "$N"); do
  p=$(printf 'part%02d' "$k"); have+=("$p"); c=("$CARRY/$p")
  if [ "$k" = "$N" ] && [ "$first" -gt 0 ]; then have+=("extra01"); c+=("$CARRY/extra01"); fi
  carries+=("${c[*]}"); calls+=("$(check "${c[*]}" "${have[@]}")"); timeouts+=(120)
done
start=1; [ "$first" -gt 0 ] && start=2
for k in $(seq "$start" "$M"); do
  p=$(printf 'extra%02d' "$k"); have+=("$p")
  carries+=("$CARRY/$p"); calls+=("$(check "$CARRY/$p" "${have[@]}")"); timeouts+=(120)
done
# the last transfer installs
last=$((${#calls[@]} - 1))
calls[last]="mkdir -p .vllm-carry && { mv /tmp/kit/* .vllm-carry/ 2>/dev/null; true; } && bash .vllm-carry/$lastx/install.sh"; timeouts[last]=420
calls+=("$script"); carries+=(""); timeouts+=(600)
total=${#calls[@]}
{
  echo "# $total device calls for issue 30's GPU run ($(mib "$xbytes") of extras + the vLLM kit's $N parts)."
  echo "# Make calls 1..$((total - 1)) back to back (the machine keeps what they left only 30 s after each);"
  echo "# call $total runs benchmarks/gpu_issue30.sh (< 9 min: it ends by its own deadline, BUDGET_S=530 s from its"
  echo "# start) and should follow at once. With less device time left, prefix it with BUDGET_S=<seconds>: the steps"
  echo "# shrink to fit (d, the benchmark, gets what a, b and c leave)."
  echo "# A call answering 'RESTART FROM part01' (exit 3) means the machine was replaced: start again at call 1."
  echo "# The checkout sends $(mib "$repo") with each call; sizes below include it (limit 64 MiB)."
  for i in $(seq 0 $((total - 1))); do
    # shellcheck disable=SC2086
    if [ -n "${carries[i]}" ]; then bytes=$(( $(sz ${carries[i]}) + repo )); else bytes=$repo; fi
    list=""
    for c in ${carries[i]}; do list="$list${list:+, }\"$c\""; done
    echo
    echo "## call $((i + 1))/$total  carry=[$list]  timeout_s=${timeouts[i]}  sends $(mib "$bytes")"
    echo "${calls[i]}"
    [ "$bytes" -le "$LIMIT" ] || { echo "call $((i + 1)) sends $(mib "$bytes") > 64 MiB" >&2; exit 1; }
    [ "$(printf '%s' "${calls[i]}" | wc -c)" -le 2000 ] || { echo "call $((i + 1)) is over 2000 characters" >&2; exit 1; }
  done
} > "$CARRY/calls_all.txt"
rm -rf "$S" "$X/extra.tar"

# 6. every wheel's needs (Requires-Dist, Python 3.12 on Linux, no extras) against what the kit and
#    the GPU machine's image hold (KINDS: the device README's package list, where this workplace has it)
KINDS=${KINDS:-/work/.library/device/KINDS.md}
if [ -f "$KINDS" ]; then
  "$PY" - "$CARRY/wheels" "$X/final" "$KINDS" <<'EOF'
import pathlib, re, sys, zipfile
from packaging.requirements import Requirement

norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "os_name": "posix", "extra": ""}
image = set()
for line in pathlib.Path(sys.argv[3]).read_text().splitlines():
    if line.startswith("nvidia-h100-x1, nvidia-h200: their image") and "Packages:" in line:
        image = {norm(n) for n in line.split("Packages:", 1)[1].strip().rstrip(".").split(", ")}
if not image:
    sys.exit(f"no package list found in {sys.argv[3]}")
wheels = sorted(pathlib.Path(sys.argv[1]).glob("*.whl")) + sorted(pathlib.Path(sys.argv[2]).glob("*.whl"))
listed = set(pathlib.Path(sys.argv[1]).parent.joinpath("wheels.list").read_text().split())
wheels = [w for w in wheels if w.parent.name != "wheels" or w.name in listed]  # LEAN leaves some out
carried = {norm(w.name.split("-")[0]): w.name.split("-")[1] for w in wheels}
missing = {}
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = norm(req.name)
        if name in carried:
            if req.specifier and not req.specifier.contains(carried[name], prereleases=True):
                print(f"  pin conflict (ignored by --no-deps): {wheel.name.split('-')[0]} wants {req}, carried {carried[name]}")
        elif name not in image:
            missing.setdefault(name, []).append(wheel.name.split("-")[0])
if missing:
    print("NEEDED AND NEITHER CARRIED NOR ON THE IMAGE:")
    for name, by in sorted(missing.items()):
        print(f"  {name} (needed by {', '.join(sorted(set(by)))})")
else:
    print(f"== every Requires-Dist of the {len(wheels)} wheels is carried or on the GPU machine's image")
EOF
fi
echo "== extras: $(wc -l < "$X/wheels.list") wheels + preset + scripts, $(mib "$xbytes") in $M part(s); first $(mib "$first") rides with $lastv"
cat "$CARRY/calls_all.txt"
