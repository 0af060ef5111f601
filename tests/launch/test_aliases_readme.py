"""packages/rl-launch/README.md's OpenRLHF mapping table is the one `rl_launch.aliases` renders
from its tables: one source of truth for which OpenRLHF flag becomes what."""

from __future__ import annotations

import pathlib

from rl_launch.aliases import render_mapping_table

README = pathlib.Path(__file__).resolve().parents[2] / "packages" / "rl-launch" / "README.md"
START, END = "<!-- openrlhf-mapping:start -->\n", "<!-- openrlhf-mapping:end -->"


def test_readme_mapping_table_is_the_rendered_alias_table():
    text = README.read_text()
    table = text[text.index(START) + len(START) : text.index(END)]
    assert table == render_mapping_table(), (
        "README's OpenRLHF table is stale: paste rl_launch.aliases.render_mapping_table() between the markers"
    )


def test_rendered_table_has_a_row_per_flag_and_meaning_with_its_status():
    rows = render_mapping_table().splitlines()[2:]
    assert "| `--data.max_len` | ppo | `--data.prompt_max_len`, `--rollout.generate_max_len`" in "\n".join(
        rows
    )
    assert any(row.startswith("| `--data.max_len` | serve-rm | `--max_len` |") for row in rows)
    statuses = {row.rsplit("|", 2)[-2].strip() for row in rows}
    assert statuses == {"same name", "renamed", "translated", "accepted, dropped with a note", "refused"}
    ring = [row for row in rows if row.startswith("| `--ds.ring_attn_size`")]
    assert ring[0].startswith(
        "| `--ds.ring_attn_size` | ppo, sft, rm, dpo | `--model.sequence_parallel_size`"
    )
    assert ring[0].endswith("| translated |")
    assert ring[1].endswith("| refused |")
    assert ring[1].startswith("| `--ds.ring_attn_size` | serve-rm |")
