"""Which cells a pytest ``-k`` expression selects, and an expression that selects exactly given
cells (a Buildkite step's ``harness run -k``).

Matching is pytest's own: the expression language of ``pytest -k``, where an identifier matches a
cell when it is a case-insensitive substring of one of the cell's keywords (its id, and its
marker names, as pytest also matches marker names)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from harness.matrix import Cell, MatrixError


def select(cells: Iterable[Cell], k_expr: str | None) -> list[Cell]:
    """Cells whose keywords satisfy a pytest ``-k`` expression (empty/None selects all)."""
    cells = list(cells)
    if k_expr is None or not k_expr.strip():
        return cells
    from _pytest.mark.expression import Expression

    try:
        expr = Expression.compile(k_expr.strip())
    except SyntaxError as e:
        raise MatrixError(f"-k {k_expr!r}: wrong expression: {e.msg if hasattr(e, 'msg') else e}") from None

    def matcher_for(cell: Cell):
        names = [n.lower() for n in cell.keywords]

        def matcher(name: str, /, **kwargs: Any) -> bool:
            if kwargs:
                raise MatrixError(f"-k {k_expr!r}: keyword expressions do not support call parameters")
            sub = name.lower()
            return any(sub in n for n in names)

        return matcher

    return [c for c in cells if expr.evaluate(matcher_for(c))]


def exact_k(cell: Cell, universe: Iterable[Cell]) -> str:
    """A pytest -k expression that selects exactly ``cell`` among ``universe``: its id, minus any
    other cell whose keywords contain the id as a substring (-k matches substrings)."""
    me = cell.id.lower()
    others = sorted({c.id for c in universe if c.id != cell.id and any(me in k.lower() for k in c.keywords)})
    return " and ".join([cell.id, *(f"not {o}" for o in others)])


def exact_k_many(unit: Sequence[Cell], universe: Iterable[Cell]) -> str:
    """A pytest -k expression that selects exactly the cells of ``unit`` among ``universe``."""
    universe = list(universe)
    parts = [exact_k(c, universe) for c in unit]
    return " or ".join(f"({p})" if " " in p and len(parts) > 1 else p for p in parts)
