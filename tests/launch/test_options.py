"""rl_launch.options on a small struct tree: docs, dotted options, value parsing, layers, errors."""

from __future__ import annotations

import argparse
import json
from typing import Literal

import msgspec
import pytest

from rl_launch.config import ConfigError
from rl_launch.options import (
    REQUIRED,
    build_parser,
    check_unknown_args,
    dump_config,
    field_docs,
    iter_options,
    load_config,
    overrides_from_namespace,
    parse_value,
)


class Inner(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    count: int = 1
    """How many; must be > 0."""

    def __post_init__(self) -> None:
        if self.count <= 0:
            raise ConfigError(f"count: {self.count!r} must be > 0")


class Optim(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    lr: float = 1e-6
    """Learning rate (100% of the peak)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    stage: Literal[0, 1, 2, 3] = 2
    """ZeRO stage."""
    inner: Inner = msgspec.field(default_factory=Inner)
    """A nested section."""


class Root(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A small tree for the tests."""

    name: str = "run"
    """Run name."""
    mode: Literal["fast", "slow"] = "fast"
    """Speed:
    fast or slow."""
    flag: bool = False
    """A switch."""
    limit: int | None = None
    """Optional limit."""
    tags: list[str] = msgspec.field(default_factory=lambda: ["a"])
    """Tags."""
    optim: Optim = msgspec.field(default_factory=Optim)
    undocumented: int = 0

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < self.optim.inner.count:
            raise ConfigError(f"limit: {self.limit} must be >= optim.inner.count = {self.optim.inner.count}")


def parser_for(cls: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    build_parser(cls, parser)
    return parser


# ---- introspection -------------------------------------------------------------------------


def test_field_docs_reads_attribute_docstrings_and_skips_undocumented_fields():
    docs = field_docs(Root)
    assert docs["name"] == "Run name."
    assert docs["mode"] == "Speed:\nfast or slow."
    assert "undocumented" not in docs
    assert field_docs(Optim)["inner"] == "A nested section."


def test_field_docs_of_a_class_without_source_is_empty():
    namespace: dict = {}
    exec("import msgspec\nclass NoSource(msgspec.Struct):\n    x: int = 1\n    'doc'\n", namespace)
    assert field_docs(namespace["NoSource"]) == {}
    assert [option.name for option in iter_options(namespace["NoSource"])] == ["x"]


def test_iter_options_gives_dotted_names_depth_first_with_defaults_and_choices():
    options = {option.name: option for option in iter_options(Root)}
    assert list(options) == [
        "name",
        "mode",
        "flag",
        "limit",
        "tags",
        "optim",
        "optim.lr",
        "optim.betas",
        "optim.stage",
        "optim.inner",
        "optim.inner.count",
        "undocumented",
    ]
    assert options["optim"].is_section
    assert options["optim.inner"].is_section
    assert not options["optim.inner.count"].is_section
    assert options["optim.inner"].doc == "A nested section."
    assert options["optim.inner"].default == Inner()
    assert options["tags"].default == ["a"]  # default_factory evaluated
    assert options["optim.stage"].choices == (0, 1, 2, 3)
    assert options["mode"].choices == ("fast", "slow")
    assert options["limit"].choices is None
    assert options["optim.lr"].default == 1e-6
    assert options["optim.lr"].doc.startswith("Learning rate")
    assert not options["name"].required


def test_iter_options_marks_a_field_without_default_as_required():
    class Needs(msgspec.Struct, kw_only=True):
        path: str

    (option,) = iter_options(Needs)
    assert option.required
    assert option.default is REQUIRED


# ---- parse_value -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("true", True),
        ("False", False),
        ("1", True),
        ("0", False),
        ("YES", True),
        ("no", False),
        ("on", True),
        ("Off", False),
    ],
)
def test_parse_value_bool_spellings(text, expected):
    assert parse_value(text, bool) is expected


@pytest.mark.parametrize(
    ("text", "type_", "expected"),
    [
        ("42", int, 42),
        ("-1", int, -1),
        ("1e-6", float, 1e-6),
        ("0.5", float, 0.5),
        ("3", float, 3.0),
        ("hello world", str, "hello world"),
        ("2", Literal[0, 1, 2, 3], 2),
        ("slow", Literal["fast", "slow"], "slow"),
        ("none", int | None, None),
        ("NULL", str | None, None),
        ("7", int | None, 7),
        ("0.9,0.95", tuple[float, float], (0.9, 0.95)),
        ("[0.9, 0.95]", tuple[float, float], (0.9, 0.95)),
        ("a, b,c", list[str], ["a", "b", "c"]),
        ('["a,b", "c"]', list[str], ["a,b", "c"]),
        ("", list[str], []),
    ],
)
def test_parse_value_converts_to_the_field_type(text, type_, expected):
    value = parse_value(text, type_)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("text", "type_", "message"),
    [
        ("maybe", bool, r"^optim\.x: expected bool \(true/false, yes/no, on/off, 1/0\), got 'maybe'$"),
        ("1.5", int, r"^optim\.x: expected int, got '1\.5'$"),
        ("abc", float, r"^optim\.x: expected float, got 'abc'$"),
        ("abc", float | None, r"^optim\.x: expected float or none, got 'abc'$"),
        ("5", Literal[0, 1, 2, 3], r"^optim\.x: '5' is not one of 0, 1, 2, 3$"),
        ("gpu", Literal["auto", "cpu"], r"^optim\.x: 'gpu' is not one of auto, cpu$"),
        ("0.9", tuple[float, float], r"^optim\.x: expected 2 float values .*got 1 in '0\.9'$"),
        ("0.9,x", tuple[float, float], r"^optim\.x: expected float, got 'x'$"),
        ("[0.9,", tuple[float, float], r"^optim\.x: expected 2 float values .*not a JSON list"),
    ],
)
def test_parse_value_rejects_bad_text_naming_field_value_and_expected(text, type_, message):
    with pytest.raises(ConfigError, match=message):
        parse_value(text, type_, name="optim.x")


# ---- argparse --------------------------------------------------------------------------------


def test_parser_keeps_only_given_options_as_strings():
    parser = parser_for(Root)
    args = parser.parse_args(["--optim.lr", "3e-4", "--optim.inner.count=4", "--flag", "--config", "x.yaml"])
    assert args.config == "x.yaml"
    assert args.print_config is False
    assert overrides_from_namespace(Root, args) == {
        "optim.lr": "3e-4",
        "optim.inner.count": "4",
        "flag": "true",
    }
    explicit = parser.parse_args(["--flag", "false", "--optim.stage", "1"])
    assert overrides_from_namespace(Root, explicit) == {"flag": "false", "optim.stage": "1"}


def test_parser_help_groups_options_by_section_with_doc_default_and_choices():
    text = parser_for(Root).format_help()
    flat = " ".join(text.split())
    assert "general: A small tree for the tests." in flat
    assert "optim: --optim.lr FLOAT Learning rate (100% of the peak). (default: 1e-06)" in flat
    assert (
        "optim.inner: A nested section. --optim.inner.count INT How many; must be > 0. (default: 1)" in flat
    )
    assert "--optim.stage {0,1,2,3} ZeRO stage. (default: 2)" in flat
    assert "--mode {fast,slow} Speed: fast or slow. (default: fast)" in flat
    assert "--optim.betas A,B Adam betas. (default: 0.9,0.95)" in flat
    assert "--limit INT Optional limit. (default: none)" in flat
    assert "--flag [{true,false}] A switch. (default: false)" in flat
    assert "--undocumented INT (default: 0)" in flat


def test_parser_does_not_take_abbreviations_and_unknown_flags_get_a_close_match():
    parser = parser_for(Root)
    _, extras = parser.parse_known_args(["--optim.l", "1", "--optim.iner.count", "2"])
    assert extras == ["--optim.l", "1", "--optim.iner.count", "2"]
    with pytest.raises(
        ConfigError,
        match=r"^optim\.l: unknown option; allowed: lr, betas, stage, inner \(did you mean lr\?\)$",
    ):
        check_unknown_args(Root, extras)
    with pytest.raises(ConfigError, match=r"^optim\.iner: unknown option; .*\(did you mean inner\?\)$"):
        check_unknown_args(Root, extras[2:])
    with pytest.raises(ConfigError, match=r"^unrecognized arguments: stray$"):
        check_unknown_args(Root, ["stray"])
    check_unknown_args(Root, [])


# ---- load_config -----------------------------------------------------------------------------


def test_load_config_layers_base_then_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: from-file\noptim:\n  lr: 1e-3\n  stage: 3\n")
    base = {"name": "from-base", "mode": "slow", "optim": {"lr": 0.5, "inner": {"count": 5}}}
    config = load_config(Root, str(path), {"optim.stage": "1", "flag": "yes"}, base=base)
    assert config == Root(
        name="from-file", mode="slow", flag=True, optim=Optim(lr=1e-3, stage=1, inner=Inner(count=5))
    )
    assert base == {"name": "from-base", "mode": "slow", "optim": {"lr": 0.5, "inner": {"count": 5}}}


def test_load_config_reads_json_and_empty_files(tmp_path):
    json_path = tmp_path / "run.json"
    json_path.write_text(json.dumps({"optim": {"betas": [0.8, 0.9]}, "limit": 3}))
    assert load_config(Root, str(json_path)) == Root(limit=3, optim=Optim(betas=(0.8, 0.9)))
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(Root, str(empty)) == Root()


def test_load_config_unknown_key_in_file_suggests_the_close_one(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  inner:\n    cuont: 2\n")
    with pytest.raises(
        ConfigError,
        match=r"^optim\.inner\.cuont: unknown option; allowed: count \(did you mean count\?\) \(in .*run\.yaml\)$",
    ):
        load_config(Root, str(path))


def test_load_config_unknown_override_suggests_the_close_one():
    with pytest.raises(
        ConfigError,
        match=r"^optim\.betaz: unknown option; allowed: lr, betas, stage, inner \(did you mean betas\?\)$",
    ):
        load_config(Root, overrides={"optim.betaz": "1,2"})
    with pytest.raises(ConfigError, match=r"^zzz: unknown option; allowed: name, mode, .*undocumented$"):
        load_config(Root, overrides={"zzz": "1"})
    with pytest.raises(ConfigError, match=r"^optim: is a section"):
        load_config(Root, overrides={"optim": "1"})


def test_load_config_section_given_a_scalar_is_rejected_by_name():
    with pytest.raises(
        ConfigError, match=r"^optim: is a section; expected a mapping of its options, got int 3"
    ):
        load_config(Root, base={"optim": 3})


def test_load_config_wrong_type_and_invalid_literal_name_the_dotted_field():
    with pytest.raises(ConfigError, match=r"^optim\.lr: expected float, got str 'abc'$"):
        load_config(Root, base={"optim": {"lr": "abc"}})
    with pytest.raises(ConfigError, match=r"^optim\.stage: 5 is not one of 0, 1, 2, 3$"):
        load_config(Root, base={"optim": {"stage": 5}})
    with pytest.raises(ConfigError, match=r"^mode: 'medium' is not one of fast, slow$"):
        load_config(Root, base={"mode": "medium"})
    with pytest.raises(ConfigError, match=r"^tags\[1\]: expected str, got int 2$"):
        load_config(Root, base={"tags": ["a", 2]})
    with pytest.raises(
        ConfigError, match=r"^optim\.betas: expected list of length 2, got 3 \(value: \[1, 2, 3\]\)$"
    ):
        load_config(Root, base={"optim": {"betas": [1, 2, 3]}})
    with pytest.raises(ConfigError, match=r"^optim\.lr: expected float, got 'fast'$"):
        load_config(Root, overrides={"optim.lr": "fast"})


def test_load_config_nested_post_init_error_gets_the_full_dotted_path():
    with pytest.raises(ConfigError, match=r"^optim\.inner\.count: 0 must be > 0$"):
        load_config(Root, overrides={"optim.inner.count": "0"})
    # A root check already names its field: kept as is.
    with pytest.raises(ConfigError, match=r"^limit: 1 must be >= optim\.inner\.count = 2$"):
        load_config(Root, overrides={"limit": "1", "optim.inner.count": "2"})


def test_load_config_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=rf"^config file {missing}: not found$"):
        load_config(Root, str(missing))


def test_load_config_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: ok\noptim:\n  lr: [1, 2\n  stage: 1\n")
    with pytest.raises(ConfigError, match=rf"^config file {path}, line 4, column \d+: invalid YAML"):
        load_config(Root, str(path))
    json_path = tmp_path / "bad.json"
    json_path.write_text('{"name": "x",\n "limit": }')
    with pytest.raises(ConfigError, match=rf"^config file {json_path}, line 2, column 11: invalid JSON"):
        load_config(Root, str(json_path))


def test_load_config_file_must_hold_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"expected a mapping of sections and options at the top, got list"):
        load_config(Root, str(path))


def test_dump_config_round_trips_through_load_config(tmp_path):
    config = load_config(
        Root,
        overrides={"name": "123", "limit": "9", "tags": "x,y", "optim.betas": "0.5,0.99", "optim.lr": "2e-7"},
    )
    text = dump_config(config)
    assert text.index("name:") < text.index("optim:") < text.index("undocumented:")
    assert "betas: [0.5, 0.99]" in text
    path = tmp_path / "dumped.yaml"
    path.write_text(text)
    loaded = load_config(Root, str(path))
    assert loaded == config
    assert loaded.name == "123"
    assert isinstance(loaded.optim.betas, tuple)
