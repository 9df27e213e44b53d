"""Markdown tables, as the reports write them."""


def row(cells):
    """One table line: "| a | b |" (an empty cell: "| |")."""
    return "|" + "|".join(f" {c} " if c != "" else " " for c in cells) + "|"


def rule(align):
    """The line under the header: align has an "l" (left) or "r" (right) per
    column."""
    return "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"


def table(header, align, rows):
    """The table's lines: header, rule(align), then one line per row of cells."""
    return [row(header), rule(align)] + [row(r) for r in rows]
