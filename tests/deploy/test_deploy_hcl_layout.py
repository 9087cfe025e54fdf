"""The HCL files keep the layout `nomad fmt` and `terraform fmt` write, and the checker can tell."""

from __future__ import annotations

from pathlib import Path

import pytest
from hcl_documents import JOBSPECS, ROOT, TERRAFORM
from hcl_layout import LayoutProblem, layout_problems

HCL_FILES = sorted([*JOBSPECS.glob("*.hcl"), *TERRAFORM.rglob("*.tf")])

WELL_FORMATTED = """\
# A comment line ends an alignment group.
job "x" {
  type        = "service"
  datacenters = ["*"]
  priority    = 70

  group "g" {
    count = 2

    network {
      port "http" {}
    }

    task "t" {
      driver = "docker"
      env = {
        SHORT       = "a"
        MUCH_LONGER = "b"
      }
      args = [
        "a", "${NOMAD_PORT_http}",
        "--flag=value",
      ]

      template {
        destination = "secrets/x.env"
        env         = var.count == 2 ? true : false
        data        = <<-EOT
        KEY={{ with nomadVar "x" }}{{ .k }}{{ end }}
          indented   = freely inside a heredoc
        EOT
        change_mode = "restart"
      }
    }
  }
}
"""


@pytest.mark.parametrize("path", HCL_FILES, ids=[str(p.relative_to(ROOT)) for p in HCL_FILES])
def test_file_has_the_fmt_layout(path: Path):
    """Each jobspec and .tf file is laid out as `nomad fmt` / `terraform fmt` would write it."""
    assert [] == [str(problem) for problem in layout_problems(path.read_text(encoding="utf-8"))]


def test_well_formatted_snippet_passes():
    """A snippet with groups, a heredoc, nested objects and lists raises no problem."""
    assert [] == layout_problems(WELL_FORMATTED)


def test_misaligned_equals_is_reported():
    """An `=` out of line with its neighbours is reported on its own line."""
    text = 'job "x" {\n  type = "service"\n  datacenters = ["*"]\n}\n'
    expected = [
        LayoutProblem(
            2,
            "'=' at column 8, expected column 15 "
            "(aligned one space after the longest name of its group)",
        )
    ]
    assert expected == layout_problems(text)


def test_over_padded_group_is_reported():
    """A group aligned further right than one space after its longest name is reported."""
    text = "x {\n  a    = 1\n  bb   = 2\n}\n"
    assert [2, 3] == [problem.line for problem in layout_problems(text)]


def test_alignment_does_not_reach_across_a_blank_line():
    """A blank line starts a new group, so aligning across it is a departure."""
    text = "x {\n  a   = 1\n\n  bbb = 2\n}\n"
    assert [2] == [problem.line for problem in layout_problems(text)]


def test_alignment_does_not_reach_across_a_multi_line_value():
    """A multi-line list ends the group, so the lines around it align separately."""
    text = 'x {\n  a      = 1\n  list = [\n    "v",\n  ]\n  longer = 2\n}\n'
    assert [2] == [problem.line for problem in layout_problems(text)]


def test_heredoc_value_takes_part_in_its_group():
    """An attribute whose value is a heredoc aligns with the attributes around it."""
    text = 'x {\n  destination = "a"\n  data = <<-EOT\n  body\n  EOT\n  env = true\n}\n'
    assert [3, 6] == [problem.line for problem in layout_problems(text)]


def test_wrong_indentation_is_reported():
    """A line indented other than two spaces per open block is reported."""
    text = 'job "x" {\n   type = "service"\n  group "g" {\n  count = 1\n  }\n}\n'
    problems = layout_problems(text)
    assert [
        LayoutProblem(2, "indented 3 spaces, expected 2"),
        LayoutProblem(4, "indented 2 spaces, expected 4"),
    ] == problems


def test_missing_space_after_equals_is_reported():
    """`name =value` is reported: one space follows every `=`."""
    assert [LayoutProblem(2, "expected one space after '='")] == layout_problems("x {\n  a =1\n}\n")


def test_comparison_operators_are_not_assignments():
    """`==`, `!=`, `<=` and `>=` inside a value neither align nor need spaces like `=`."""
    text = "x {\n  a = b==c\n  cc = d!=e\n}\n"
    assert [
        LayoutProblem(
            2,
            "'=' at column 5, expected column 6 "
            "(aligned one space after the longest name of its group)",
        )
    ] == layout_problems(text)


def test_misaligned_trailing_comments_are_reported():
    """Trailing comments on consecutive lines line up one space after the longest content."""
    text = "x {\n  a  = 1 # one\n  bb = 22   # two\n}\n"
    assert [2, 3] == [problem.line for problem in layout_problems(text)]


def test_tabs_and_trailing_whitespace_are_reported():
    """Tabs and trailing spaces are departures from the formatter's output."""
    text = "x {\n\ta = 1\n  b = 2  \n}\n"
    messages = [problem.message for problem in layout_problems(text)]
    assert "tab character" in messages
    assert "trailing whitespace" in messages
