"""The one percentile and table renderer of bench/ and `rehearse` reports."""
from scheduling.reporting import median, percentile, render_table


def test_percentiles_interpolate_between_ranks_and_keep_exact_values_as_they_are():
    assert percentile([4, 1, 3, 2], 95) == 3.85
    assert percentile([10.0, None, 30.0], 50) == 20.0  # missing values are left out
    assert median([300, 100, 200]) == 200 and isinstance(median([300, 100, 200]), int)
    assert percentile([], 95) is None


def test_a_table_aligns_columns_and_marks_group_breaks():
    table = render_table(["path", "seconds"], [["copy", "0.21"], None, ["job", "10.40"]], right={1})

    assert table.splitlines() == [
        "path  seconds",
        "----  -------",
        "copy     0.21",
        "",
        "job     10.40",
    ]
