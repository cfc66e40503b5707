"""The structured masks (docs/semantics.md, "Packed sequences, sliding windows and causal alignment")
as one framework-free value: `Structure`.

What the modules take as keywords (is_causal, window, segment_ids, key_segment_ids, alignment) is
checked here once, from shapes and dtypes alone (never the values, so it runs under jit and
torch.compile), and read back by every user: each module's builder turns it into a keep-mask in
its own array library, the chunked kernel takes its diagonal band, the harness and the peers their
keywords or sides. The float64 oracle (`parity.reference.structured_keep`) keeps a NumPy mask of
its own, held to this one by tests/test_structure.py.

chunk= (Llama 4's chunked attention) is such a field: causal within chunks of C positions, not a band.
A new mask kind is a field here (checked in `of`, asked in `asks_nothing`, spelt in `keywords`; a
band kind only in `band`), and one line in each module's builder.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np


ALIGNMENTS = ("top-left", "bottom-right")
"""Where query t sits among the keys: a(t) = t (top-left) or t + S - T (bottom-right)."""


def is_int(x) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def window_sides(window) -> tuple[int | None, int | None]:
    """window None | w | (left, right) -> (left, right), each an int >= 0 or None (unbounded).
    Python ints: the window is the program's shape, not data (never traced)."""
    if window is None:
        return None, None
    if is_int(window):
        window = (window, window)
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise TypeError(f"window must be None, an int or a (left, right) pair, got {window!r}")
    sides = []
    for name, w in zip(("left", "right"), window):
        if w is not None and (not is_int(w) or w < 0):
            raise ValueError(f"window {name} must be a non-negative int or None, got {w!r}")
        sides.append(None if w is None else int(w))
    return sides[0], sides[1]


def check_chunk(chunk) -> int:
    """chunk=C of Llama 4's chunked attention: a positive Python int (the program's shape, never data)."""
    if not is_int(chunk) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int (attention_chunk_size), got {chunk!r}")
    return int(chunk)


_CACHE_RULE = "the cache's rule is the mask (new token i of row b keeps slots starts[b] <= s <= lengths[b] + i)"


def check_segment_shape(shape, name: str, batch: int | None, length: int | None, axis: str) -> None:
    """Segment ids of shape (B, L) (None: any size there); ValueError naming them otherwise."""
    shape = tuple(shape)
    if len(shape) != 2 or any(want is not None and got != want for got, want in zip(shape, (batch, length))):
        want = ", ".join(f"{n}={v}" if v is not None else n for n, v in (("B", batch), (axis, length)))
        raise ValueError(f"{name} must have shape (B, {axis}) with {want}, got {shape}")


def integer_array(x, name: str):
    """The default dialect check of segment ids: an array (NumPy, jax, anything with a NumPy dtype) of
    integers; TypeError otherwise. The modules pass their own (torch tensors have no NumPy dtype)."""
    try:
        kind = np.dtype(x.dtype).kind
    except (AttributeError, TypeError):
        kind = None
    if kind not in ("i", "u") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an array of integers, got {type(x).__name__} "
                        f"of dtype {getattr(x, 'dtype', None)}")
    return x


@dataclass(frozen=True)
class Structure:
    """The structured masks of a (T, S) attention, checked. Query t sits at key a(t) = t + offset
    (offset 0 top-left, S - T bottom-right); is_causal keeps s <= a(t); the window sides keep
    a(t) - left <= s <= a(t) + right (None: unbounded); segment_ids (B, T) and key_segment_ids (B, S)
    keep equal ids. The ids are the caller's arrays (any array library; only their shapes are read
    here, and they take no part in ==); key_segment_ids IS segment_ids when it was defaulted (T = S).
    chunk C (Llama 4's chunked local attention, `attention_chunk_size`) keeps a(t) // C == s // C: a query
    sees the keys of its own chunk of C positions only; it needs is_causal (`Structure.of` implies it:
    Llama 4's chunked layers are causal), and it is not a band (`band` is None with it: the whole mask is
    a keep-mask, `segments_only` carries it).
    Build one with `Structure.of` (the modules' keywords).
    """

    T: int
    S: int
    is_causal: bool = False
    left: int | None = None
    right: int | None = None
    alignment: str = "top-left"
    segment_ids: Any = field(default=None, compare=False, repr=False)  # (B, T)
    key_segment_ids: Any = field(default=None, compare=False, repr=False)  # (B, S)
    chunk: int | None = None

    def __post_init__(self):
        if not isinstance(self.is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {self.is_causal!r}")
        if not isinstance(self.alignment, str) or self.alignment not in ALIGNMENTS:
            raise ValueError(f"alignment={self.alignment!r} is not one of {ALIGNMENTS}")
        for name, w in (("left", self.left), ("right", self.right)):
            if w is not None and (not is_int(w) or w < 0):
                raise ValueError(f"window {name} must be a non-negative int or None, got {w!r}")
        if (self.segment_ids is None) != (self.key_segment_ids is None):
            raise ValueError("a Structure holds both sides' segment ids or neither (Structure.of defaults the keys')")
        if self.chunk is not None:
            check_chunk(self.chunk)
            if not self.is_causal:
                raise ValueError(f"chunk={self.chunk} without is_causal: a chunk is causal within it "
                                 "(Structure.of implies is_causal)")

    @classmethod
    def of(cls, T: int, S: int, *, is_causal: bool = False, window=None, segment_ids=None, key_segment_ids=None,
           alignment: str = "top-left", batch: int | None = None,
           ids: Callable[[Any, str], Any] = integer_array, chunk: int | None = None) -> Structure:
        """The modules' keywords checked (TypeError/ValueError naming them), from shapes and dtypes alone.
        window None | w | (left, right); batch: the B the segment ids must have (None: any); ids(x, name):
        the caller's array library's check of one side's ids (type and integer dtype, a TypeError);
        chunk C: Llama 4's chunked attention, which implies is_causal (a chunk is causal within it)."""
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
        if chunk is not None:
            is_causal = check_chunk(chunk) > 0  # True: chunked attention is causal (Llama 4's)
        if not isinstance(alignment, str) or alignment not in ALIGNMENTS:
            raise ValueError(f"alignment={alignment!r} is not one of {ALIGNMENTS}")
        left, right = window_sides(window)
        if segment_ids is None and key_segment_ids is not None:
            raise ValueError("key_segment_ids without segment_ids: pass the queries' segment ids too")
        q_seg = k_seg = None
        if segment_ids is not None:
            q_seg = ids(segment_ids, "segment_ids")
            check_segment_shape(q_seg.shape, "segment_ids", batch, T, "T")
            if key_segment_ids is None:
                if T != S:
                    raise ValueError(f"segment_ids {tuple(q_seg.shape)} with T={T} != S={S}: "
                                     f"pass key_segment_ids (B, S) too")
                k_seg = q_seg
            else:
                k_seg = ids(key_segment_ids, "key_segment_ids")
                check_segment_shape(k_seg.shape, "key_segment_ids", q_seg.shape[0], S, "S")
        return cls(T, S, is_causal, left, right, alignment, q_seg, k_seg, None if chunk is None else int(chunk))

    @staticmethod
    def refuse_with_cache(*, is_causal=False, window=None, segment_ids=None, key_segment_ids=None,
                          alignment="top-left") -> None:
        """ValueError naming the structured keywords given beside a KV cache, whose own rule is the mask;
        read before any check of them (a wrong value is refused as given). Not chunk=: Llama 4's chunks are
        the cache's too (`KVCache.keep_mask(T, chunk=C)`), so the modules pass it to the cache, not here."""
        given = [name for name, asked in (("is_causal", is_causal is not False), ("window", window is not None),
                                          ("segment_ids", segment_ids is not None),
                                          ("key_segment_ids", key_segment_ids is not None),
                                          ("alignment", alignment != "top-left"))
                 if asked]
        if given:
            raise ValueError(f"{', '.join(given)} with a cache: {_CACHE_RULE}")

    @property
    def offset(self) -> int:
        """a(t) - t: 0 (top-left) or S - T (bottom-right)."""
        return self.S - self.T if self.alignment == "bottom-right" else 0

    @property
    def window(self) -> tuple[int | None, int | None] | None:
        """(left, right), or None when neither side bounds."""
        return None if self.left is None and self.right is None else (self.left, self.right)

    @property
    def shared_ids(self) -> bool:
        """Whether the keys' segment ids are the queries' (key_segment_ids defaulted)."""
        return self.segment_ids is not None and self.key_segment_ids is self.segment_ids

    @property
    def asks_nothing(self) -> bool:
        """Whether the structure keeps every key of every query (no keep-mask to build)."""
        return self.band() is None and self.segment_ids is None and self.chunk is None

    @property
    def plain_causal(self) -> bool:
        """Exactly tril(ones(T, S)): is_causal alone, top-left (torch SDPA's is_causal)."""
        return (self.is_causal and self.window is None and self.segment_ids is None and self.offset == 0
                and self.chunk is None)

    def band(self) -> tuple[int | None, int | None] | None:
        """is_causal, window and alignment as the band of diagonals they keep: (lo, hi) such that query t
        keeps key s exactly when lo <= s - t <= hi (a side of None: unbounded), or None when none of them
        asks. Python ints: a band is the program's shape, never data. Segment ids are not a band, nor is
        a chunk: with chunk it is None (a chunked kernel that skipped blocks by the causal band alone would
        keep keys of earlier chunks), and the whole mask is a keep-mask (`segments_only`)."""
        if self.chunk is not None:
            return None
        o = self.offset
        his = [o + h for h, on in ((0, self.is_causal), (self.right, self.right is not None)) if on]
        lo, hi = (None if self.left is None else o - self.left), (min(his) if his else None)
        return None if lo is None and hi is None else (lo, hi)

    def band_only(self) -> Structure:
        """What `band` expresses: this structure without its segment ids (with chunk: nothing, as band is None)."""
        if self.chunk is not None:
            return replace(self, is_causal=False, left=None, right=None, segment_ids=None, key_segment_ids=None,
                           chunk=None)
        return replace(self, segment_ids=None, key_segment_ids=None)

    def segments_only(self) -> Structure:
        """What `band` does not express: this structure's segment ids alone (no causal order, no window); with
        chunk the whole structure (none of it is a band)."""
        if self.chunk is not None:
            return self
        return replace(self, is_causal=False, left=None, right=None)

    def keywords(self) -> dict:
        """The modules' keywords that ask for this structure, only those that ask (`Structure.of` of them
        gives it back): is_causal, window (left, right), segment_ids, key_segment_ids (when not defaulted),
        alignment (when not top-left)."""
        kw = {}
        if self.is_causal:
            kw["is_causal"] = True
        if self.window is not None:
            kw["window"] = self.window
        if self.segment_ids is not None:
            kw["segment_ids"] = self.segment_ids
            if not self.shared_ids:
                kw["key_segment_ids"] = self.key_segment_ids
        if self.alignment != "top-left":
            kw["alignment"] = self.alignment
        if self.chunk is not None:
            kw["chunk"] = self.chunk
        return kw
