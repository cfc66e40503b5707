"""`Kernel`: the one spelling of "which attention kernel", as benchmark rows, tune runs and reports show it.

A label is NAME[:QxK[/hC]][ (PAREN)]:

- NAME: a kernel's name ("einsum", "chunked", "dpa-xla", "sdpa", "bmm-softmax", "xla", a peer's name);
- QxK: the blocks (q_chunk x k_chunk), ASCII digits without sign or leading zero, so that the round
  trip is exact; /hC: the head blocks run a step (only with blocks);
- PAREN: "interpret" (a Pallas kernel run in interpret mode), a source ("built-in", "weights", ...)
  or both, "interpret, SOURCE".

Anything after a colon that is not QxK[/hC] stays part of the name ("sdpa:flash", "sdpa:flash+math",
a "+"-joined list of requests), so every label written so far reads back and prints as it was.
Framework-free: `mha_jax.kernels` checks its own names over this, torch's labels are built with it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

INTERPRET = "interpret"


def _is_positive_decimal(text: str) -> bool:
    return text.isascii() and text.isdigit() and not text.startswith("0")


def _positive_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1


@dataclass(frozen=True)
class Kernel:
    """A kernel label as a value: `Kernel.parse(text)` reads one, `str()` writes it back unchanged."""

    name: str
    blocks: tuple[int, int] | None = None  # (q_chunk, k_chunk)
    head_chunk: int | None = None  # head blocks per step (None: all at once)
    source: str | None = None  # where the choice came from: "built-in", "weights", ...
    interpret: bool = False  # a Pallas kernel run in interpret mode

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"Kernel.name must be a string, got {type(self.name).__name__}")
        if self.blocks is not None:
            if not (isinstance(self.blocks, tuple) and len(self.blocks) == 2 and all(map(_positive_int, self.blocks))):
                raise ValueError(f"Kernel.blocks must be None or two positive integers, got {self.blocks!r}")
        if self.head_chunk is not None:
            if type(self.head_chunk) is not int or self.head_chunk < 1:
                raise ValueError(f"head_chunk must be a positive integer or None, got {self.head_chunk!r}")
            if self.blocks is None:
                raise ValueError(f"Kernel.head_chunk {self.head_chunk} needs blocks")
        if self.source is not None and (not isinstance(self.source, str) or not self.source):
            raise ValueError(f"Kernel.source must be None or a non-empty string, got {self.source!r}")
        if not isinstance(self.interpret, bool):
            raise TypeError(f"Kernel.interpret must be a bool, got {type(self.interpret).__name__}")

    @classmethod
    def parse(cls, text) -> Kernel:
        """A label -> Kernel (the module docstring's grammar); TypeError for a non-string."""
        if isinstance(text, Kernel):
            return text
        if not isinstance(text, str):
            raise TypeError(f"a kernel label is a string, got {type(text).__name__}")
        base, paren = text, None
        if text.endswith(")") and " (" in text:
            base, _, paren = text[:-1].partition(" (")
        source, interpret = paren, False
        if paren == INTERPRET:
            source, interpret = None, True
        elif paren is not None and paren.startswith(INTERPRET + ", "):
            source, interpret = paren[len(INTERPRET) + 2:], True
        if source == "" or (source is not None and (source.startswith(" ") or " (" in source)):
            return cls(text)  # not a parenthesis `str` writes: the whole text is the name
        name, blocks, head_chunk = cls._blocks(base)
        return cls(name, blocks, head_chunk, source, interpret)

    @staticmethod
    def _blocks(base: str) -> tuple[str, tuple[int, int] | None, int | None]:
        """"chunked:256x512/h2" -> ("chunked", (256, 512), 2); a base without QxK[/hC] is all name."""
        name, sep, rest = base.partition(":")
        blocks, slash, heads = rest.partition("/")
        q, x, k = blocks.partition("x")
        heads_ok = not slash or (heads.startswith("h") and _is_positive_decimal(heads[1:]))
        if sep and x and _is_positive_decimal(q) and _is_positive_decimal(k) and heads_ok:
            return name, (int(q), int(k)), int(heads[1:]) if slash else None
        return base, None, None

    def bare(self) -> Kernel:
        """The kernel without its source and interpret mark (what a tune candidate is named by)."""
        return Kernel(self.name, self.blocks, self.head_chunk)

    def __str__(self) -> str:
        label = self.name
        if self.blocks is not None:
            label += f":{self.blocks[0]}x{self.blocks[1]}"
            if self.head_chunk is not None:
                label += f"/h{self.head_chunk}"
        paren = ", ".join(p for p in ((INTERPRET if self.interpret else None), self.source) if p)
        return f"{label} ({paren})" if paren else label
