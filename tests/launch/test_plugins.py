"""`--plugin`: user modules that register estimators and losses, imported in the driver and every actor.

- A plugin named by module resolves to its file and the folder it is importable under; one named
  by a .py path resolves to its absolute path and the module name `rl_launch_plugin_<stem>`.
- Importing the refs again (the driver does it more than once) runs the plugin only once.
- Errors start with `plugins[<i>]: <spec>:` and say what went wrong: not found as a module
  (importable from where), no such file, or the exception the plugin raised and its line.
- Refs resolved in one working directory import in a fresh process with another one (an actor).
- End to end (in test_plugin_every_kind.py, one run for every plugin): `rl-launch ppo --plugin
  tests/launch/plugin_example.py` trains with the plugin's loss, and every actor imported the
  plugin once.
"""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys
import textwrap
import uuid

import msgspec
import pytest
import torch

from rl_algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, aggregate_loss, compute_advantages
from rl_launch.plugins import (
    FILE_MODULE_PREFIX,
    PluginError,
    PluginRef,
    import_plugins,
    resolve_plugins,
)

EXAMPLE = pathlib.Path(__file__).with_name("plugin_example.py")


@pytest.fixture
def isolated(monkeypatch, tmp_path_factory):
    """Undo what importing plugins does to this process: sys.path, plugin modules, the registries."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    modules = set(sys.modules)
    plugin_folders = (str(tmp_path_factory.getbasetemp()), str(EXAMPLE))
    registries = [(registry, dict(registry)) for registry in (ADVANTAGE_ESTIMATORS, POLICY_LOSSES)]
    executions = getattr(sys, "plugin_example_executions", None)
    yield
    for name in set(sys.modules) - modules:
        if str(getattr(sys.modules[name], "__file__", None)).startswith(plugin_folders):
            del sys.modules[name]
    for registry, entries in registries:
        registry.clear()
        registry.update(entries)
    if executions is None:
        vars(sys).pop("plugin_example_executions", None)
    else:
        sys.plugin_example_executions = executions


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def _write_plugin(path: pathlib.Path, loss_name: str, extra: str = "") -> pathlib.Path:
    """A plugin file registering the policy loss `loss_name` (a copy of `reinforce`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        textwrap.dedent(f"""
            from rl_algos import POLICY_LOSSES
            {extra}
            @POLICY_LOSSES.register({loss_name!r})
            def loss(logprobs, old_logprobs, advantages, action_mask):
                return POLICY_LOSSES["reinforce"](logprobs, old_logprobs, advantages, action_mask)
        """)
    )
    return path


# ----------------------------------------------------------------------------- resolving and importing


def test_a_module_name_resolves_to_its_file_and_folder_and_registers_on_import(
    isolated, tmp_path, monkeypatch
):
    package, loss_name = _unique("plugpkg"), _unique("loss")
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    source = _write_plugin(tmp_path / package / "losses.py", loss_name)
    monkeypatch.chdir(tmp_path)  # found in the working directory, which is not on sys.path here

    (ref,) = resolve_plugins([f"{package}.losses"])
    assert ref == PluginRef(
        spec=f"{package}.losses", module=f"{package}.losses", path=str(source), search_path=str(tmp_path)
    )
    assert loss_name not in POLICY_LOSSES  # resolving imports nothing of the plugin itself
    (module,) = import_plugins([ref])
    assert module is sys.modules[f"{package}.losses"]
    assert POLICY_LOSSES[loss_name] is module.loss


def test_a_file_path_resolves_to_an_absolute_path_and_a_stable_module_name(isolated, tmp_path, monkeypatch):
    stem, loss_name = _unique("my-plugin"), _unique("loss")
    source = _write_plugin(tmp_path / "plugins" / f"{stem}.py", loss_name)
    monkeypatch.chdir(tmp_path)

    (ref,) = resolve_plugins([f"plugins/{stem}.py"])
    assert ref.path == str(source.resolve())
    assert ref.module == FILE_MODULE_PREFIX + stem.replace("-", "_")
    assert ref.from_file
    (module,) = import_plugins([ref])
    assert sys.modules[ref.module] is module
    assert POLICY_LOSSES[loss_name] is module.loss


def test_importing_the_same_refs_twice_runs_each_plugin_once(isolated, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_file = _write_plugin(tmp_path / f"{_unique('twice')}.py", _unique("loss"))
    by_name = _write_plugin(tmp_path / f"{_unique('twice')}.py", _unique("loss"))
    refs = resolve_plugins([str(by_file), by_name.stem])
    first = import_plugins(refs)
    # a second execution would register the losses again, which the registry refuses
    assert import_plugins(refs) == first
    assert import_plugins(resolve_plugins([str(by_file), by_name.stem])) == first


def test_the_example_plugin_registers_an_estimator_and_a_loss_that_follow_the_conventions(isolated):
    (module,) = import_plugins(resolve_plugins([str(EXAMPLE)]))
    import_plugins(resolve_plugins([str(EXAMPLE)]))
    assert module.EXECUTIONS == sys.plugin_example_executions == 1

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0])
    group_ids = torch.tensor([0, 0, 1, 1, 2])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0]])
    advantages, returns = compute_advantages(
        "plugin_centered", rewards=rewards, group_ids=group_ids, action_mask=mask, values=None, scale=2.0
    )
    expected = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0])[:, None] * mask  # 2·(r − group mean); alone: 0
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)

    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.9]] * 5)).requires_grad_()
    old = logprobs.detach() - torch.tensor([0.0, math.log(2.0), 0.0])  # ratio 1, 2, 1
    per_token, metrics = POLICY_LOSSES["plugin_pg"](logprobs, old, advantages, mask)
    torch.testing.assert_close(per_token, -advantages * torch.tensor([1.0, 2.0, 1.0]))
    assert set(metrics) == {"ppo_kl", "ratio_mean"}
    assert all(value.ndim == 0 and not value.requires_grad for value in metrics.values())
    torch.testing.assert_close(metrics["ratio_mean"], torch.tensor(12 / 9))  # 3 of 9 action tokens at ρ = 2
    loss = aggregate_loss(per_token, mask, "token-mean")
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- errors


def test_a_module_that_is_not_found_says_it_was_tried_as_a_module_name(isolated, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PluginError) as caught:
        resolve_plugins(["no_such_plugin_module"])
    message = str(caught.value)
    assert message.startswith("plugins[0]: no_such_plugin_module: no module named 'no_such_plugin_module'")
    assert "tried as a module name" in message
    assert str(tmp_path) in message
    assert "PYTHONPATH" in message


def test_a_missing_file_names_its_index_and_absolute_path(isolated, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = _write_plugin(tmp_path / f"{_unique('good')}.py", _unique("loss"))
    with pytest.raises(PluginError) as caught:
        resolve_plugins([str(good), "plugins/missing.py"])
    message = str(caught.value)
    assert message.startswith("plugins[1]: plugins/missing.py: no such file")
    assert str(tmp_path / "plugins" / "missing.py") in message


def test_a_plugin_that_raises_names_the_exception_and_its_line(isolated, tmp_path):
    source = tmp_path / f"{_unique('broken')}.py"
    source.write_text("import os\n\nRATE = 1 / 0\n")
    refs = resolve_plugins([str(source)])
    with pytest.raises(PluginError) as caught:
        import_plugins(refs)
    assert str(caught.value) == (
        f"plugins[0]: {source}: importing it raised ZeroDivisionError: division by zero (at {source}:3)"
    )
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    assert refs[0].module not in sys.modules  # a later attempt starts afresh


def test_a_plugin_with_a_missing_dependency_is_not_reported_as_not_found(isolated, tmp_path, monkeypatch):
    name = _unique("needs_dependency")
    (tmp_path / f"{name}.py").write_text("import not_an_installed_dependency\n")
    monkeypatch.chdir(tmp_path)
    refs = resolve_plugins([name])
    with pytest.raises(PluginError) as caught:
        import_plugins(refs)
    assert str(caught.value).startswith(
        f"plugins[0]: {name}: importing it raised ModuleNotFoundError: "
        "No module named 'not_an_installed_dependency'"
    )


def test_two_files_with_one_stem_and_one_file_under_two_names_are_refused(isolated, tmp_path, monkeypatch):
    stem = _unique("same")
    first = _write_plugin(tmp_path / "a" / f"{stem}.py", _unique("loss"))
    second = _write_plugin(tmp_path / "b" / f"{stem}.py", _unique("loss"))
    with pytest.raises(PluginError, match=r"^plugins\[1\]: .* would be imported as rl_launch_plugin_"):
        resolve_plugins([str(first), str(second)])
    monkeypatch.chdir(tmp_path / "a")
    with pytest.raises(PluginError, match=r"^plugins\[1\]: .* is the file of plugins\[0\]"):
        resolve_plugins([str(first), stem])


@pytest.mark.parametrize("spec", ["", "my plugin", "plugins/readme.txt"])
def test_a_spec_that_is_neither_a_module_name_nor_a_python_file_is_refused(isolated, spec):
    with pytest.raises(PluginError, match=r"^plugins\[0\]: "):
        resolve_plugins([spec])


# ----------------------------------------------------------------------------- another process


_ACTOR = """
import sys, msgspec
from rl_algos import POLICY_LOSSES
from rl_launch.plugins import PluginRef, import_plugins
refs = msgspec.json.decode(sys.argv[1], type=tuple[PluginRef, ...])
modules = import_plugins(refs)
assert import_plugins(refs) == modules
print(sys.argv[2] in POLICY_LOSSES, modules[0].__file__)
"""


@pytest.mark.parametrize("kind", ["module", "file"])
def test_a_plugin_resolved_in_one_directory_imports_in_a_process_started_in_another(
    kind, isolated, tmp_path, monkeypatch
):
    driver_dir, actor_dir = tmp_path / "driver", tmp_path / "actor"
    actor_dir.mkdir()
    name, loss_name = _unique("cwd_plugin"), _unique("loss")
    source = _write_plugin(driver_dir / f"{name}.py", loss_name)
    monkeypatch.chdir(driver_dir)
    refs = resolve_plugins([name if kind == "module" else f"{name}.py"])

    result = subprocess.run(
        [sys.executable, "-c", _ACTOR, msgspec.json.encode(refs).decode(), loss_name],
        cwd=actor_dir,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", str(source)]


def test_an_actor_that_cannot_find_the_plugin_file_names_the_process(isolated, tmp_path):
    ref = PluginRef(
        spec="gone.py", module=FILE_MODULE_PREFIX + "gone", path=str(tmp_path / "gone.py"), from_file=True
    )
    with pytest.raises(PluginError, match=r"^plugins\[0\]: gone.py: no such file .* in this process \(pid"):
        import_plugins([ref])


# ----------------------------------------------------------------------------- end to end
