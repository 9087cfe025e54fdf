"""devcluster's node files: a task's argument naming a file the nodes have opens its copy."""

from __future__ import annotations

from pathlib import Path

from caravan_llm.devcluster.nomad.drivers import node_files


def test_absolute_paths_present_under_the_node_root_are_mapped_with_a_note(tmp_path: Path) -> None:
    """`-m /opt/models/x.gguf` and `--model=/opt/...` point at the copy; other args stay."""
    model = tmp_path / "opt" / "models" / "x.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"")
    args = ["-m", "/opt/models/x.gguf", "--model=/opt/models/x.gguf", "/opt/models/none.gguf"]

    mapped, notes = node_files(args, tmp_path)

    assert ["-m", str(model), f"--model={model}", "/opt/models/none.gguf"] == mapped
    assert (f"devcluster: node file /opt/models/x.gguf is {model}",) * 2 == notes


def test_without_a_node_root_nothing_is_mapped() -> None:
    """Tasks see the host's own files when devcluster has no node root."""
    assert (["-m", "/opt/models/x.gguf"], ()) == node_files(["-m", "/opt/models/x.gguf"], None)
