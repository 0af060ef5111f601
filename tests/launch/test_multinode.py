"""`rl-launch ppo` on a Ray cluster of three nodes, each with a network of its own.

Every node is a Linux network namespace on this machine (its own loopback, its own ports)
joined to the others by a bridge, so an address that only works on one node (127.0.0.1, a port
probed somewhere else) fails here as it would between machines. The head node (driver, one
CPU), node 2 and node 3 (one CPU each) run `ray start`; the two policy ranks (one CPU each) and
the engine (one CPU) can only land on three different nodes. The run starts as `ray job submit`
starts its entrypoint (RAY_ADDRESS and the job's config in the environment, no --ray.address),
trains two steps, and every weight sync must arrive intact: the learners met at policy rank 0's
node, the engine joined the sync group there.

Needs root (network namespaces, a bridge); skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.launch.launching import kill_processes, launcher_env, ray_processes, read_metrics

pytestmark = pytest.mark.slow

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
NODES = 3
GCS_PORT = 6379  # every namespace has its own ports: no clash with another Ray on this machine


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class NetnsCluster:
    """A bridge, one namespace and one Ray node per node; `run(command)` runs on the head node."""

    def __init__(self) -> None:
        tag = secrets.token_hex(2)
        self.bridge, self.prefix = f"rlb{tag}", f"rl{tag}n"
        self.subnet = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
        self.namespaces: list[str] = []
        self.links: list[str] = []
        self.temp_dirs: list[str] = []
        # every node and the driver hold the cluster's token (the head turns token auth on)
        self.env = launcher_env(RAY_AUTH_MODE="token")

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node}"

    def in_node(self, node: int, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[node - 1], *command]

    def network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for node in range(1, NODES + 1):
            namespace, link = f"{self.prefix}{node}", f"rlv{self.prefix[2:]}{node}"
            _ip("netns", "add", namespace)
            self.namespaces.append(namespace)
            _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            self.links.append(link)
            _ip("link", "set", link, "master", self.bridge)
            _ip("link", "set", link, "up")
            _ip("netns", "exec", namespace, "ip", "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            _ip("netns", "exec", namespace, "ip", "link", "set", "eth0", "up")
            _ip("netns", "exec", namespace, "ip", "link", "set", "lo", "up")

    def start_ray(self) -> None:
        """`ray start` on the head node, then on nodes 2 and 3 at once (each start is mostly waits)."""
        for node in range(1, NODES + 1):
            self.temp_dirs.append(tempfile.mkdtemp(prefix=f"rlm{node}-", dir="/tmp"))  # short socket paths
        self._wait_started([self._start_node(1)])
        self._wait_started([self._start_node(node) for node in range(2, NODES + 1)])

    def _start_node(self, node: int) -> tuple[int, subprocess.Popen]:
        common = [
            "--node-ip-address", self.address(node),
            "--num-cpus", "1",
            "--object-store-memory", str(200 * 2**20),
            "--temp-dir", self.temp_dirs[node - 1],
            "--disable-usage-stats",
        ]  # fmt: skip
        if node == 1:
            command = [RAY, "start", "--head", "--port", str(GCS_PORT), "--include-dashboard", "false"]
        else:
            command = [RAY, "start", "--address", f"{self.address(1)}:{GCS_PORT}"]
        process = subprocess.Popen(
            self.in_node(node, [*command, *common]),
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        return node, process

    @staticmethod
    def _wait_started(starts: list[tuple[int, subprocess.Popen]]) -> None:
        failed = []
        for node, process in starts:
            try:
                out, err = process.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
            if process.returncode != 0:
                failed.append(f"ray start on node {node} failed (exit {process.returncode}):\n{out}\n{err}")
        if failed:
            raise RuntimeError("\n".join(failed))

    def processes(self) -> dict[int, str]:
        found = {}
        for temp_dir in self.temp_dirs:
            found.update(ray_processes(temp_dir))
        return found

    def close(self) -> dict[int, str]:
        """Stop every Ray process of the cluster and remove the network; the processes that lived on."""
        for pid in self.processes():  # not `ray stop`: it would stop every Ray on the machine
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 2  # Ray's idle workers may ignore SIGTERM: then SIGKILL
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        kill_processes(list(self.processes()))
        deadline = time.monotonic() + 2  # a killed process leaves /proc a moment later
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        leftovers = self.processes()
        for link in self.links:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("link", "del", link)
        for namespace in self.namespaces:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", namespace)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.bridge)
        for temp_dir in self.temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)
        return leftovers


@pytest.fixture
def netns_cluster():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to give each Ray node a network namespace")
    cluster = NetnsCluster()
    try:
        cluster.network()
    except subprocess.CalledProcessError as error:
        cluster.close()
        pytest.skip(f"cannot build the namespaces' network here: {error.stderr.strip()}")
    try:
        cluster.start_ray()
        yield cluster
    finally:
        leftovers = cluster.close()
        left_network = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
        left_namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not leftovers, f"Ray processes outlived the cluster: {leftovers}"
    assert cluster.bridge not in left_network
    assert cluster.prefix not in left_namespaces


def test_policy_ranks_on_two_nodes_and_engine_on_a_third_train_and_sync(
    netns_cluster, tiny_checkpoint, tmp_path
):
    prompts = tmp_path / "train.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"What is {a} + 1?", "label": str(a + 1)}) + "\n" for a in range(16))
    )
    run_dir = tmp_path / "run"
    args = [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", str(prompts),
        "--reward.function", "numeric",
        "--algo.advantage.estimator", "grpo",
        "--rollout.engine", "hf",  # what is tested is where ranks meet, not the engine
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.rollout_batch_size", "4",
        "--rollout.generate_max_len", "4",
        "--train.max_steps", "2",
        "--ray.policy.num_actors", "2",
        "--ray.policy.num_cpus_per_actor", "1",
        "--ray.engine_num_cpus", "1",
        "--ray.startup_timeout_s", os.environ.get("RL_TEST_STARTUP_TIMEOUT_S", "300"),
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
    ]  # fmt: skip
    # Started as `ray job submit -- rl-launch ppo ...` starts its entrypoint on the head node: the
    # cluster's address in RAY_ADDRESS (no --ray.address) and the job's config, whose runtime
    # environment sets a variable the launcher forwards too (ray.init refuses a second one)
    job = {"runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1"}}, "metadata": {}}
    env = {
        **netns_cluster.env,
        "RAY_ADDRESS": f"{netns_cluster.address(1)}:{GCS_PORT}",
        "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job),
        "HF_HUB_OFFLINE": "1",
    }
    result = subprocess.run(
        netns_cluster.in_node(1, [sys.executable, "-m", "rl_launch.cli", "ppo", *args]),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert f"ray.address {env['RAY_ADDRESS']}: from RAY_ADDRESS" in result.stderr
    assert f"ray: joined {env['RAY_ADDRESS']}" in result.stdout + result.stderr
    # Each node has one CPU and each actor takes one: the ranks and the engine are on three nodes.
    joined = {rank: _rendezvous_line(run_dir / "logs" / f"policy-{rank}.log") for rank in (0, 1)}
    node_0, master = joined[0]
    node_1, master_seen_by_1 = joined[1]
    assert node_0 != node_1
    assert master.split(":")[0] == node_0
    assert master_seen_by_1 == master
    assert f"bucketed broadcast (gloo) from {node_0}:" in result.stdout
    metrics = [line for line in read_metrics(run_dir) if "health/sync_checksum_match" in line]
    assert len(metrics) == 2
    assert all(line["health/sync_checksum_match"] == 1.0 for line in metrics)


def _rendezvous_line(log) -> tuple[str, str]:
    """(node address, rendezvous address) from a learner's "... on node X (...) joins at H:P" line."""
    for line in log.read_text().splitlines():
        if " joins at " in line and " on node " in line:
            return line.split(" on node ")[1].split()[0], line.split(" joins at ")[1].strip()
    raise AssertionError(f"no rendezvous line in {log}")
