"""A holder path as structure: the one value from the holder search to every reader.

The search (``cudamem.holders._search``) finds, for a storage, the chains of references from a root
(a module global, a class, a running frame, ...) down to it. ``cudamem.holders`` writes
each chain as a ``HolderPath``: a root kind and its steps, each step with a kind and the
text it is written as. Readers ask the path, never its text:

* ``held`` is what Python holds: the steps before the first arrow step (``→``: into an
  autograd graph, into another frame, or through an object that names no attribute);
* the **container** is ``held`` up to its first integer subscript (a list or tuple index,
  an integer dict key, a ``Sequential`` entry) or object key (a parameter keying
  ``optimizer.state``): ``__main__.loss_history[3]`` → ``__main__.loss_history``,
  ``__main__.opt.state[<model[0].weight>]['exp_avg']`` → ``__main__.opt.state``. A path
  without one is its own container: a variable, an attribute, a dict entry under a named
  key;
* the **item** is the container's entry (``__main__.errors[2]``), the **pattern** the held
  steps with each integer subscript as ``[*]`` (``model.step_outputs[*]['preds']``), the
  **shape** the whole path written so;
* ``through_graph``: whether an autograd graph lies on the way.

Text is made at the edge: ``str(path)`` (and ``Holder.path``) is the steps' text joined.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ARROWS", "LASTING_ROOTS", "UNROOTED_ROOTS", "HolderPath", "Step"]

#: Step kinds that start a new part of the path, written `` → ...``: an autograd graph
#: (``graph``), another frame's local (``frame``), an object reached through a reference
#: that names no attribute (``object``).
ARROWS = frozenset({"graph", "frame", "object"})

#: Root kinds no root explains: an object gc sees no referrer of, a cycle, where a search
#: cut short had got to. They never make culprits of their own.
UNROOTED_ROOTS = frozenset({"unknown", "cycle", "partial"})

#: Roots that outlive any one call: a path from one of them names what keeps the memory,
#: where a running frame's local (often a library's ``args`` tuple) only passes it along.
LASTING_ROOTS = frozenset({"global", "class", "ipython"})


#: Roots whose first step names a variable already (``__main__.model``, a frame's local).
_NAMED_ROOTS = frozenset({"global", "traceback", "ipython", "frame"})


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a holder path.

    ``kind`` is one of: ``root`` (the root and its first name: ``__main__.model``, a frame's
    local, ``<Tensor object>``), ``attr`` (``.weight``), ``key`` (``['a']``), ``index``
    (``[3]``), ``closure`` (`` (closure 'x')``), ``member`` (`` (set member)``), ``keyof``
    (`` (dict key)``), ``self`` (the object a bound method is bound to: `` → LitModel``),
    and the arrows (``ARROWS``).
    """

    kind: str
    #: The step as written, e.g. ``.weight``, ``[3]``, `` → grad_fn MeanBackward0``.
    text: str
    #: An integer subscript's value: a list index, an integer dict key, a module list entry.
    index: int | None = None
    #: Where a group of paths differs in this step: the subscript written for all of them
    #: (``0..2999``, ``*``).
    varies: str | None = None
    #: A dict entry under an object with no source form (a parameter keying
    #: ``optimizer.state``, written ``[<model[0].weight>]``): one entry of a container, as
    #: an integer subscript is.
    object_key: bool = False

    @property
    def entry(self) -> bool:
        """Whether the step picks one of many like entries: an integer subscript or an
        object key (what a container is cut at, and ``[*]`` in a pattern)."""
        return self.index is not None or self.object_key


@dataclass(frozen=True, slots=True)
class HolderPath:
    """A root and the steps from it down to what holds the memory (module notes)."""

    #: ``global``, ``class``, ``frame``, ``traceback``, ``ipython``, ``cycle``, ``unknown``,
    #: ``partial``.
    root_kind: str
    steps: tuple[Step, ...]

    def __str__(self) -> str:
        return self.text

    @property
    def text(self) -> str:
        """The path as Python-like text: ``__main__.loss_history[3] → grad_fn ...``."""
        return "".join(s.text for s in self.steps)

    def text_in(self, module: str) -> str:
        """The text as code in ``module`` writes it: a root in that module's globals without
        the module's name (``losses[3]`` for ``__main__.losses[3]`` in ``__main__``)."""
        if not self.steps or self.steps[0].kind != "root":
            return self.text
        root = self.steps[0].text
        if not root.startswith(module + "."):
            return self.text
        return root[len(module) + 1 :] + "".join(s.text for s in self.steps[1:])

    @property
    def pattern(self) -> str:
        """The text with each step that differs across a group written as its range or
        ``*`` (``__main__.log[0..2999]``)."""
        return "".join(s.text if s.varies is None else f"[{s.varies}]" for s in self.steps)

    @property
    def held(self) -> tuple[Step, ...]:
        """What Python holds: the steps before the first arrow."""
        for i, s in enumerate(self.steps):
            if s.kind in ARROWS:
                return self.steps[:i]
        return self.steps

    @property
    def first_step(self) -> str:
        """``held`` as text."""
        return "".join(s.text for s in self.held)

    @property
    def through_graph(self) -> bool:
        """Whether the path reaches the memory through an autograd graph."""
        return any(s.kind == "graph" for s in self.steps)

    @property
    def rooted(self) -> bool:
        """Whether a root explains the path (see ``UNROOTED_ROOTS``)."""
        return self.root_kind not in UNROOTED_ROOTS

    @property
    def lasting(self) -> bool:
        """Whether the root outlives any one call (see ``LASTING_ROOTS``)."""
        return self.root_kind in LASTING_ROOTS

    @property
    def as_dict_key(self) -> bool:
        """Whether the path ends at a dict key (the tensor is a key, not a value)."""
        return bool(self.steps) and self.steps[-1].kind == "keyof"

    def _cut(self) -> int:
        """Index in ``held`` of the first integer subscript after the root, or -1."""
        held = self.held
        for i in range(1, len(held)):
            if held[i].entry:
                return i
        return -1

    @property
    def container(self) -> str:
        """The container the path names (see the module notes)."""
        held, i = self.held, self._cut()
        return "".join(s.text for s in (held if i < 0 else held[:i]))

    @property
    def item(self) -> str:
        """The container's entry the path goes through: ``errors[2]`` of ``errors[2].x``."""
        held, i = self.held, self._cut()
        return "".join(s.text for s in (held if i < 0 else held[: i + 1]))

    @property
    def in_container(self) -> bool:
        """Whether what Python holds ends in a subscript or goes through an integer one (an
        entry of a container, not a plain variable or attribute)."""
        held = self.held
        if len(held) > 1 and held[-1].kind in ("key", "index"):
            return True
        return self._cut() >= 0

    @property
    def owner(self) -> str:
        """The variable the path starts from: ``__main__.model`` for
        ``__main__.model.lm_head.weight``, ``train.py:12 in main(): model`` for a local,
        ``Cache.store`` for a class attribute."""
        steps = self.steps
        if not steps:
            return ""
        if self.root_kind in _NAMED_ROOTS or len(steps) < 2 or steps[1].kind != "attr":
            return steps[0].text
        return steps[0].text + steps[1].text

    @property
    def item_pattern(self) -> str:
        """``held`` with every integer subscript and object key written ``[*]``."""
        return "".join("[*]" if s.entry else s.text for s in self.held)

    @property
    def shape(self) -> str:
        """The whole path with every integer subscript and object key written ``[*]``: how
        a storage is held, whichever entry holds it (``errors[*].__traceback__.tb_next → f.py:9 in
        step(): loss → grad_fn SumBackward0 → AddmmBackward0 saved mat1``)."""
        return "".join("[*]" if s.entry else s.text for s in self.steps)
