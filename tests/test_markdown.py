"""The Markdown table header the reports share."""

from qlora_nb_utils.bench.markdown import table_header


def test_separator_has_one_cell_per_column():
    head, sep = table_header(["a", "b c", "d"])
    assert head == "| a | b c | d |"
    assert sep == "|---|---|---|"
    assert head.count("|") == sep.count("|")
