"""The placement said in plain terms: a short table, and the search's choice in words a user reads once."""

from offload_strategy.session.plans import placement_table, searched_placement_line


def test_the_table_lists_tiers_in_order_with_units_and_bytes():
    rows = placement_table({"nvme": [8, 7 << 20], "host": [19, 6 << 20]})
    assert [row.split("|")[0].strip() for row in rows] == ["tier", "host", "nvme"]
    assert rows[1].split() == ["host", "|", "19", "|", "6.00", "MiB"] and len({len(row) for row in rows}) == 1


def test_the_search_line_says_what_stays_and_what_is_copied_in():
    assert searched_placement_line(0, 27, 17, 0.0201) == (
        "tiered: placement search (fastest predicted step 20.1 ms): all 27 units copied in when used, through 17 GPU buffers")
    partial = searched_placement_line(5, 27, 4, 0.5)
    assert "5 of 27 units kept in the GPU tier, 22 copied in through 4 buffers" in partial and len(partial) <= 130
    assert searched_placement_line(27, 27, 0, 0.5).endswith("all 27 units stay in the GPU tier")
