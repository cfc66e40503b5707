"""The decode check: a prefill and single-token steps with a KV cache, judged against one causal forward.

On a decode case (`Case(decode=True)`: causal self-attention over T tokens x (B, T, E)) the
layer runs the way generation runs it (docs/semantics.md, "Decoding with a KV cache"):

    prompt   the first P = T - 3 tokens, rows left-padded by 0, 2, 1, 3, ... tokens (capped below P)
    steps    the last 3 tokens, one call each
    cache    capacity T + 1 slots per row, made with the rows' left padding (`starts`)

and every call's output is judged against the float64 oracle's ONE causal forward over the T
tokens (`reference.forward` with `reference.decode_keep(starts, T)` and, with RoPE,
`reference.decode_positions(starts, T)`; a chunked case, Llama 4's, `decode_keep(starts, T, chunk=C)`:
the chunks counted from each row's first token, and our decoders are given chunk=C at every call),
by the forward check's judge and bounds (three-way with the oracle's own maths in the dtype as the
yardstick, in every dtype: `parity.harness.judge`, `parity.tolerances`).
Only real tokens are judged: a left-padding query attends nothing, so its output is the masked-row
policy's, not a token's. A RoPE whose table follows the call (LongRoPE: long factors once the call's largest
position passes the original context) has no one forward as its truth: each call rotates with its own
table and the cached keys keep theirs, so the oracle is stitched per call (`_switching_oracle`: q_rot and
k_rot from the forward with each call's table, the scores, weights and output from `reference.decode`).

Rows (check "decode", reference "oracle"); the quantity names the call: "prefill" (the prompt's
real tokens), "step 1", "step 2", "step 3"; for ours also "cache": the cache after the last step (its
lengths, and at each row's valid slots the keys after RoPE and the values vs the oracle's k_rot and
v). RoPE scores see only the difference of two positions, so a cache whose keys are rotated at the
wrong positions can still give the right outputs: that row, and the cross-framework rows, tell.

  ours         torch and torch-fused (eager), jax-jit and jax-fused (one jax.jit: the prompt and
               then one compiled step for every position); the prompt is one call. torch-static: torch
               with a StaticKVCache written in place, whose prompt's cache its steps spend, so no
               cross-framework row continues it (`continues_twice`)
  torch->jax   the prompt by torch, the cache converted (`parity.cache_transfer.torch_to_jax`), the steps
               by jax-jit; jax->torch the reverse (rows for the steps)
  decoders     every Implementation with decode=True (peers and the user's): fn(p, x_t, cache,
               position) -> (out, cache) fed one token per call, prompt included (position -1 for
               a left-padding token); the other implementations of the user's are skip rows; on a
               chunked case a skip row (`CHUNK_DECODER_SKIP`: the protocol gives no chunk)

Each row of ours names the kernel of its own call (`kernel`): torch's from the profiler around that
call, JAX's from the jaxpr of the program that call ran (the prompt's and the step's programs differ,
so a kernel table may pick one kernel for the prompt and another for a step); the `cache` row names
none (the keys and values are written before any attention kernel runs). A decoder's rows name what
its run ran (torch: the profiler around the run; JAX: its first step's trace).

Every dtype the run selects decodes, 16-bit included, judged as the forward check judges it (the
yardstick of `parity.tolerances` at the dtype the implementation is judged at), for every call and the
cache.

A failing row of ours names the first stage (`DECODE_STAGES`) of that call that leaves the oracle:
the cache it was given (keys after RoPE and values at the row's valid slots vs the oracle's k_rot
and v), the new tokens' q, k, v, q_rot, k_rot, the returned cache at the new slots ("write"), the
scores and weights over the cache's slots (weights path), the context, else "output". A decoder's
cache is its own: its failing rows name "prefill" or "step output" (the first call off the oracle)
and the message says, per batch row, the first position off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from parity import reference
from parity.harness.checks.oracle import layer_fields
from parity.harness.judge import judge, status
from parity.harness.report import Row, error_row
from parity.impls import Implementation, builtin
from parity.peers.common import MissingPackage
from parity.tolerances import Comparison, envelope, yardstick_runs

STEPS = 3  # single-token steps after the prompt (fewer when the case has fewer tokens)
STARTS = (0, 2, 1, 3)  # left padding of row b: STARTS[b % 4], capped below the prompt length
DECODE_STAGES = ("cache", "q", "k", "v", "q_rot", "k_rot", "write", "scores", "weights", "context", "output")
"""Where a call of our modules can leave the oracle, in the order the data flows."""
DECODER_STAGES = ("prefill", "step output")
"""What a decoder's failing rows name: its cache is its own, so the first call off the oracle."""

NO_KERNEL = ("", "")  # rows of no call (a skip, an error, the cache, a retrace)
CROSS = (("torch->jax", "torch", "jax-jit"), ("jax->torch", "jax-jit", "torch"))  # (row name, prompt by, steps by)
EAGER_JAX_DECODE_SKIP = ("decode runs our JAX module jitted (jax-jit, jax-fused): one compiled step for every "
                         "position, as a decoder runs it")
COMPILE_DECODE_SKIP = "decode runs our torch module eager (torch, torch-fused)"
STATIC_NOTE = ("a StaticKVCache written in place: each call spent the cache it was given, so no cross-framework "
               "row continues its prompt (that would be a second continuation of one prefix)")
CHUNK_DECODER_SKIP = ("a decoder fn(p, x_t, cache, position) is given no chunk: the decode protocol has no keyword for "
                      "Llama 4's chunked attention, so its cache would keep every causal key; our modules decode the "
                      "chunked case (their caches' chunked keep-mask)")


@dataclass(frozen=True)
class Schedule:
    """How a decode case's T tokens are fed: a prompt of `prompt` tokens, then `steps` single tokens."""

    prompt: int
    steps: int
    capacity: int
    starts: np.ndarray  # (B,) int64: each row's left-padding tokens

    @property
    def tokens(self) -> int:
        return self.prompt + self.steps

    def calls(self) -> list[tuple[str, int, int]]:
        """(label, first token, end) per call: the prompt in one, then one per step."""
        return [("prefill", 0, self.prompt)] + [(f"step {i + 1}", self.prompt + i, self.prompt + i + 1)
                                                for i in range(self.steps)]

    def real(self, lo: int, hi: int) -> np.ndarray:
        """bool (B, hi - lo): the tokens of columns lo..hi-1 that are not left padding."""
        return np.arange(lo, hi)[None, :] >= self.starts[:, None]

    def positions(self) -> np.ndarray:
        """(B, T) int64: each token's RoPE position in its row, -1 on the left padding (the protocol's)."""
        pos = reference.decode_positions(self.starts, self.tokens)
        return np.where(self.real(0, self.tokens), pos, -1)

    def describe(self) -> str:
        return (f"prompt {self.prompt} tokens + {self.steps} steps, left padding {','.join(map(str, self.starts))}, "
                f"capacity {self.capacity}")


MIN_TOKENS = 2  # a prompt of one token, then one step


def tokens_problem(tokens: int) -> str | None:
    """Why a decode over `tokens` tokens cannot run (None: it can)."""
    if tokens < MIN_TOKENS:
        return (f"a decode needs at least {MIN_TOKENS} tokens (a prompt of one token, then a step with the cache), "
                f"got {tokens}")
    return None


def schedule(shape) -> Schedule:
    """The schedule of a decode case's shape (see the module docstring)."""
    T = shape.T
    if shape.cross or tokens_problem(T):
        raise ValueError(f"shape {shape.name}: decoding is self-attention over at least {MIN_TOKENS} tokens, got "
                         f"cross={shape.cross}, T={T}")
    steps = min(STEPS, T - 1)
    prompt = T - steps
    starts = np.array([min(STARTS[b % len(STARTS)], prompt - 1) for b in range(shape.B)], np.int64)
    return Schedule(prompt, steps, T + 1, starts)


def _oracle(unit, policy: str, at: str | None = None):
    """(float64 intermediates, the yardstick judged at `at` (default the run dtype; `Oracle.forward`'s), the keep-mask
    (B, 1, T, T)) of the one causal forward the decode case's calls must equal, under the masked-row policy `policy`."""
    at = at or unit.dtype
    return unit.oracle.cached(("decode", policy, at), lambda: _decode_oracle(unit, policy, at))


def _decode_oracle(unit, policy: str, at: str):
    s, sch, chunk = unit.case.shape, schedule(unit.case.shape), unit.case.chunk
    sd = {k: reference.as_float64(v) for k, v in unit.x.state_dict.items()}
    x = reference.as_float64(unit.x.query)
    keep = reference.decode_keep(sch.starts, sch.tokens, chunk=chunk)  # (B, 1, T, T); chunks from each row's start
    kw = {"num_heads": s.N, "num_kv_heads": s.num_kv_heads, "rope": s.rope, "rope_theta": s.rope_theta,
          "masked_rows": policy, **layer_fields(s)}
    if s.rope is not None or s.attn_temperature_tuning:  # Llama 4's NoPE temperature reads the queries' positions
        pos = reference.decode_positions(sch.starts, sch.tokens)  # (B, T)
        kw.update(positions=pos, **({"key_positions": pos} if s.rope is not None else {}))
    if s.rope_scaling is not None and s.rope_scaling.switches:
        def maths(sd, xs, dt):
            return _switching_oracle(sd, xs[0], dt, sch, keep, kw, chunk)
        exact = maths(sd, (x,), np.float64)
        return exact, envelope(exact, yardstick_runs(maths, sd, (x,), at)), keep
    exact = reference.forward(sd, x, x, x, keep, **kw)
    runs = yardstick_runs(lambda sd, xs, dt: reference.forward(sd, *xs, keep, dtype=dt, **kw), sd, (x, x, x), at)
    return exact, envelope(exact, runs), keep


def _one_table(scaling, long: bool):
    """LongRoPE `scaling` held to one of its tables (both lists that one, its attention factor kept): a forward
    with it rotates every token as a call that picked that table does, whatever the positions."""
    factors = scaling.long_factor if long else scaling.short_factor
    return dataclasses.replace(scaling, short_factor=factors, long_factor=factors, attention_factor=scaling.scale)


def _switching_oracle(sd, x, dtype, sch: Schedule, keep, kw: dict, chunk=None):
    """The decode's truth for a layer whose RoPE table follows the call (LongRoPE): no one forward is it, since
    each call rotates its tokens with the table its largest position picks and the keys cached before keep
    theirs. q, k, v (and the norms) are a forward's; q_rot and k_rot, per call, the forward with that call's
    table; the scores, weights and output the oracle's own decode (`reference.decode`, which picks the table
    per call), over the T tokens; no context (the decode keeps none: a slip there is named at "output")."""
    scaling, pos = kw["rope_scaling"], kw["positions"]
    fixed = {long: reference.forward(sd, x, x, x, keep, dtype=dtype, **{**kw, "rope_scaling": _one_table(scaling, long)})
             for long in (False, True)}
    dec_kw = {k: v for k, v in kw.items() if k not in ("positions", "key_positions")}
    dec = reference.decode(sd, x, starts=sch.starts, prefill=sch.prompt, capacity=sch.capacity, dtype=dtype,
                           chunk=chunk, **dec_kw)
    calls = sch.calls()
    tables = [fixed[scaling.uses_long(int(pos[:, lo:hi].max()))] for _, lo, hi in calls]
    T = sch.tokens

    def stitched(name):  # (B, n, T, H): each call's tokens from its table's forward
        return np.concatenate([getattr(f, name)[:, :, lo:hi] for f, (_, lo, hi) in zip(tables, calls)], axis=2)

    return dataclasses.replace(fixed[False], q_rot=stitched("q_rot"), k_rot=stitched("k_rot"), context=None,
                               scores=np.concatenate([a[..., :T] for a in dec.scores], axis=2),  # (B, N, T, T)
                               weights=np.concatenate([a[..., :T] for a in dec.weights], axis=2),
                               output=dec.output, sink_weights=None)


# ---------------------------------------------------------------- running ours


@dataclass
class Call:
    """One call of our module: its tokens, what it returned, the cache it was given and the one it returned,
    and the kernel it ran."""

    label: str
    lo: int
    hi: int
    out: np.ndarray  # (B, hi - lo, E)
    stages: dict
    given: object  # parity.cache_transfer.NumpyKVCache, (B, K, C, H)
    cache: object  # the framework's cache it returned
    after: object  # that cache as a NumpyKVCache
    before: object = None  # the framework's cache it was given
    kernel: tuple = ("", "")  # (kernel, note): what this call ran (`_read_kernels`)


def _run(unit, dec, sch: Schedule, x, calls, cache, impl: Implementation) -> list[Call]:
    """Feed `calls` ((label, lo, hi) of the schedule) of x (B, T, E) to `dec` (runner.decoder) from `cache`;
    each call's kernel is read around that call alone where its runner observes calls (torch's profiler)."""
    from parity import cache_transfer  # both frameworks' caches: imported when a decode unit runs

    out = []
    for label, lo, hi in calls:
        given, before = cache_transfer.to_numpy(cache), cache
        with unit.runner(impl).observe(impl) as seen:
            y, stages, cache = dec.call(cache, x[:, lo:hi])
        out.append(Call(label, lo, hi, y, stages, given, cache, cache_transfer.to_numpy(cache), before, seen.kernel))
    return out


def _read_kernels(unit, impl: Implementation, dec, calls: list[Call], x) -> list[Call]:
    """The calls with the kernel each ran: as `_run` observed them, or where the runner reads a call's program
    instead (our JAX decoder: the jaxpr of the program that call ran, a trace from the cache that call was given,
    no compile; `decode_call_kernel`), as it reads them. The prompt and the steps are different programs (T
    differs), so a kernel table may pick a kernel for each; the steps are one program (the `compiles` row says
    so), read once."""
    runner = unit.runner(impl)
    read: dict[int, tuple[str, str] | None] = {}
    out = []
    for call in calls:
        T = call.hi - call.lo
        if T not in read:
            read[T] = runner.decode_call_kernel(impl, dec, call.before, x[:, call.lo:call.hi])
        out.append(call if read[T] is None else dataclasses.replace(call, kernel=read[T]))
    return out


def _convert(cache, to: str, unit):
    """Our cache of one framework as the other's (`to`), on the unit's device, bit for bit."""
    from parity import cache_transfer

    if to == "jax":
        return cache_transfer.torch_to_jax(cache, device=unit.runners["jax"].device)
    return cache_transfer.jax_to_torch(cache, device=unit.runners["torch"].device)


# ---------------------------------------------------------------- judging


def _masked(a, mask):
    return np.where(mask, reference.as_float64(a), 0.0)


def _judge_masked(actual, expected, yard, mask, table) -> Comparison:
    """The forward judge on the places `mask` keeps (0 elsewhere on every side)."""
    return judge(_masked(actual, mask), _masked(expected, mask), table.forward, table.three_way_k,
                 None if yard is None else _masked(yard, mask))


def _judge_call(unit, sch: Schedule, lo: int, hi: int, out, exact, low, table) -> Comparison:
    real = sch.real(lo, hi)  # (B, L)
    e = exact.output[:, lo:hi][real]  # (n, E)
    return judge(np.asarray(out)[real], e, table.forward, table.three_way_k,
                 None if low is None else low.output[:, lo:hi][real])


def _off_tokens(out, expected, real, c: Comparison) -> np.ndarray:
    """bool (B, L): the real tokens whose output is off the row's bound (or NaN where the oracle is not)."""
    a, e = reference.as_float64(out), reference.as_float64(expected)
    with np.errstate(invalid="ignore"):
        over = np.abs(a - e) > (c.atol or 0.0) + (c.rtol or 0.0) * np.abs(e)
    bad = (over & ~np.isnan(e)) | (np.isnan(a) != np.isnan(e))
    return bad.any(axis=-1) & real


def _where_off(sch: Schedule, off: np.ndarray) -> str:
    """Per batch row, the first position off the oracle (off: bool (B, T) over every token judged)."""
    pos = reference.decode_positions(sch.starts, sch.tokens)
    parts, rows_off = [], []
    for b in range(off.shape[0]):
        cols = np.nonzero(off[b])[0]
        parts.append(f"row {b} {'none' if not cols.size else f'position {pos[b, cols[0]]}'}")
        if cols.size:
            rows_off.append(b)
    text = "first position off the oracle per row (left padding " + ",".join(map(str, sch.starts)) + "): " + ", ".join(parts)
    padded = [b for b in range(off.shape[0]) if sch.starts[b] > 0]
    if rows_off and rows_off == padded and len(padded) < off.shape[0]:
        text += "; only the left-padded rows are off: is the left padding attended?"
    return text


def _cache_stage(sch: Schedule, exact, low, table, c, first: int, end: int, length: int, stage: str) -> dict | None:
    """{"stage", "message"} where the cache c leaves the oracle: its lengths (`length` in every row), then its
    keys (after RoPE where there is one) and values over slots [first, end), valid slots only; else None."""
    if not np.array_equal(c.lengths, np.full_like(c.lengths, length)):
        return {"stage": stage, "message": f"{stage}: lengths {c.lengths.tolist()}, expected {length} in every row"}
    if end <= first:
        return None
    valid = (np.arange(first, end)[None, :] >= sch.starts[:, None])[:, None, :, None]  # (B, 1, n, 1)
    key = "k_rot" if exact.k_rot is not None else "k"
    for name, got, oracle in (("keys", c.k[:, :, first:end], key), ("values", c.v[:, :, first:end], "v")):
        e = getattr(exact, oracle)[:, :, first:end]
        y = None if low is None else getattr(low, oracle)[:, :, first:end]
        if not _judge_masked(got, e, y, valid, table).passed:
            return {"stage": stage, "message": f"{stage}: the {name} at slots {first}..{end - 1} are off the "
                                               f"oracle's {oracle} (valid slots only)"}
    return None


def _stage(unit, sch: Schedule, call: Call, exact, low, keep, table) -> dict:
    """{"stage": the first of DECODE_STAGES where this call leaves the oracle, "message": what differs there}."""
    lo, hi, T = call.lo, call.hi, sch.tokens

    def side(name, first, end):
        return getattr(exact, name)[:, :, first:end], None if low is None else getattr(low, name)[:, :, first:end]

    def cache_stage(c, first, end, length, stage):
        return _cache_stage(sch, exact, low, table, c, first, end, length, stage)

    found = cache_stage(call.given, 0, lo, lo, "cache")
    if found:
        return found
    real4 = sch.real(lo, hi)[:, None, :, None]  # (B, 1, L, 1)
    for name in ("q", "k", "v", "q_rot", "k_rot"):
        if name not in call.stages or getattr(exact, name) is None:
            continue
        got = call.stages[name]
        e, y = side(name, lo, hi)
        if np.shape(got) != np.shape(e):
            return {"stage": name, "message": f"{name} has shape {np.shape(got)}, the oracle's new tokens {np.shape(e)}"}
        if not _judge_masked(got, e, y, real4, table).passed:
            return {"stage": name}
    found = cache_stage(call.after, lo, hi, hi, "write")
    if found:
        return found
    for name in ("scores", "weights"):
        if name not in call.stages:
            continue
        got = np.asarray(call.stages[name])
        B, N = exact.q.shape[:2]
        if got.shape != (B, N, hi - lo, sch.capacity):
            return {"stage": name, "message": f"{name} has shape {got.shape}, expected {(B, N, hi - lo, sch.capacity)} "
                                              "(B, N, T, C: over the cache's slots)"}
        valid = real4 & (keep[:, :, lo:hi] if name == "scores" else True)  # scores where a key is kept
        e, y = side(name, lo, hi)
        if not _judge_masked(got[..., :T], e, y, valid, table).passed:
            return {"stage": name}
    if "context" in call.stages and exact.context is not None:  # a switching RoPE's oracle keeps none
        got, real3 = call.stages["context"], sch.real(lo, hi)[:, :, None]
        y = None if low is None else low.context[:, lo:hi]
        if np.shape(got) == exact.context[:, lo:hi].shape and not _judge_masked(
                got, exact.context[:, lo:hi], y, real3, table).passed:
            return {"stage": "context"}
    return {"stage": "output"}


def _cache_row(unit, impl: Implementation, sch: Schedule, final, exact, low, table) -> Row:
    """The cache after the last step against the oracle: every row's lengths T, and at its valid slots
    the keys after RoPE (k_rot; k without RoPE) and the values. The outputs depend on the keys' rotations
    only through their differences, so this is what makes a cache one the other framework can continue."""
    T = sch.tokens
    if not np.array_equal(final.lengths, np.full_like(final.lengths, T)):
        return unit.row("decode", impl, "oracle", "fail", "cache", stage="cache", kernel=NO_KERNEL,
                        message=f"lengths {final.lengths.tolist()} after {T} tokens, expected {T} in every row")
    key = "k_rot" if exact.k_rot is not None else "k"
    valid = (np.arange(T)[None, :] >= sch.starts[:, None])[:, None, :, None]  # (B, 1, T, 1)
    got = np.stack([reference.as_float64(final.k[:, :, :T]), reference.as_float64(final.v[:, :, :T])])
    expected = np.stack([getattr(exact, key), exact.v])
    yard = None if low is None else np.stack([getattr(low, key), low.v])
    c = _judge_masked(got, expected, yard, valid[None], table)
    message = f"the keys after RoPE ({key}) and the values at every row's valid slots, lengths {T}"
    kw = {} if c.passed else {"stage": "cache"}
    if not c.passed:
        bad = [n for n, i in (("keys", 0), ("values", 1)) if not _judge_masked(got[i], expected[i], None if yard is None
                                                                              else yard[i], valid, table).passed]
        message += f"; off: {', '.join(bad)}"
    return unit.row("decode", impl, "oracle", status(c), "cache", c, message=message, kernel=NO_KERNEL, **kw)


def _call_note(sch: Schedule, label: str, lo: int, by: str) -> str:
    if label == "prefill":
        return f"{sch.prompt} prompt tokens {by}; {sch.describe()}; left-padding tokens not judged"
    pos = reference.decode_positions(sch.starts, sch.tokens)[:, lo]
    return f"token {lo} (positions {','.join(map(str, pos))})"


def _rows_of_calls(unit, impl: Implementation, sch: Schedule, calls, exact, low, keep, table, by: str,
                   extra: str = "", every: str = "") -> list[Row]:
    """One row per call of ours: its real tokens' output judged; a failing one names its stage.
    extra: said on the last row when all pass; every: said on every row."""
    judged = [(call, _judge_call(unit, sch, call.lo, call.hi, call.out, exact, low, table)) for call in calls]
    off = np.zeros((sch.starts.shape[0], sch.tokens), bool)
    for call, c in judged:
        if not c.passed:
            off[:, call.lo:call.hi] = _off_tokens(call.out, exact.output[:, call.lo:call.hi], sch.real(call.lo, call.hi), c)
    where = _where_off(sch, off) if off.any() else ""
    rows = []
    for n, (call, c) in enumerate(judged):
        message = [every, _call_note(sch, call.label, call.lo, by), unit.judged_note(impl)]
        kw = {}
        if not c.passed:
            kw = _stage(unit, sch, call, exact, low, keep, table)
            message += [kw.pop("message", ""), where]
        elif n == len(judged) - 1 and not off.any():
            message.append(extra)
        rows.append(unit.row("decode", impl, "oracle", status(c), call.label, c,
                             message="; ".join(m for m in message if m), kernel=call.kernel, **kw))
    return rows


# ---------------------------------------------------------------- the check


def _skip(unit, impl: Implementation, why: str) -> Row:
    return unit.row("decode", impl, "oracle", "skip", message=why, kernel=NO_KERNEL)


def _error(unit, impl: Implementation, e: BaseException) -> Row:
    return error_row(unit, "decode", impl, "oracle", e, kernel=NO_KERNEL)


def _ours(unit, impl: Implementation, sch: Schedule, runs: dict) -> list[Row]:
    if unit.runner(impl).replays_jit(impl):
        return [_skip(unit, impl, EAGER_JAX_DECODE_SKIP)]
    if impl.mode == "compile":
        return [_skip(unit, impl, COMPILE_DECODE_SKIP)]
    why = unit.why_not_here(impl)
    if why:
        return [_skip(unit, impl, why)]
    policy = impl.policy(unit.case.masked_rows)
    exact, low, keep = _oracle(unit, policy, unit.judged(impl))
    table = unit.table(impl)
    try:
        dec = unit.decoder(impl, policy)
        traced = len(getattr(dec, "traces", ()))
        calls = _run(unit, dec, sch, unit.x.query, sch.calls(),
                     dec.empty(sch.starts.shape[0], sch.capacity, sch.starts), impl)
    except Exception as e:
        return [_error(unit, impl, e)]
    if dec.continues_twice:  # a static cache's prompt is spent by its steps: no other framework continues it
        runs[impl.name] = calls
    extra, rows = "", []
    if hasattr(dec, "traces"):
        steps = dec.traces[traced:].count(1)
        extra = f"one jitted step served the {sch.steps} steps" if steps <= 1 else ""
        if steps > 1:
            rows.append(unit.row("decode", impl, "oracle", "fail", "compiles", kernel=NO_KERNEL, message=(
                f"the jitted step was traced {steps} times for {sch.steps} single-token steps: one compiled step "
                "must serve every position (the cache's lengths are data, not shapes)")))
    if not dec.continues_twice:
        extra = STATIC_NOTE
    calls = _read_kernels(unit, impl, dec, calls, unit.x.query)  # after the retrace count: a reading traces
    by = unit.runner(impl).decode_how
    rows = _rows_of_calls(unit, impl, sch, calls, exact, low, keep, table, by, extra) + rows
    return rows + [_cache_row(unit, impl, sch, calls[-1].after, exact, low, table)]


def _cross(unit, sch: Schedule, runs: dict) -> list[Row]:
    """The prompt by one framework, its cache converted, the steps by the other: rows for the steps."""
    rows = []
    for name, first, then in CROSS:
        if first not in runs or then not in runs:
            continue
        impl = dataclasses.replace(builtin(then), name=name)
        policy = impl.policy(unit.case.masked_rows)
        exact, low, keep = _oracle(unit, policy, unit.judged(impl))
        try:
            dec = unit.decoder(builtin(then), policy)
            cache = _convert(runs[first][0].cache, builtin(then).framework, unit)
            calls = _read_kernels(unit, builtin(then), dec,
                                  _run(unit, dec, sch, unit.x.query, sch.calls()[1:], cache, builtin(then)), unit.x.query)
        except Exception as e:
            rows.append(_error(unit, impl, e))
            continue
        every = f"the prompt by {first}, its cache converted, the steps by {then}"
        rows += _rows_of_calls(unit, impl, sch, calls, exact, low, keep, unit.table(impl), "", every=every)
    return rows


def _decoder(unit, impl: Implementation, sch: Schedule) -> list[Row]:
    """A decoder (decode=True) through the protocol, one token per call (not on a chunked case: `CHUNK_DECODER_SKIP`)."""
    why = unit.why_not_here(impl)
    if why:
        return [_skip(unit, impl, why)]
    if unit.case.chunk is not None:
        return [_skip(unit, impl, f"{impl.name}: {CHUNK_DECODER_SKIP} (chunk={unit.case.chunk})")]
    policy = impl.policy(unit.case.masked_rows)
    exact, low, keep = _oracle(unit, policy, unit.judged(impl))
    table = unit.table(impl)
    try:
        built = unit.built(impl, policy)
        runner = unit.runner(impl)
        with runner.observe(impl, expected=impl.role == "ours") as seen:
            out = runner.decode_tokens(built, unit.x.query, sch.positions())  # (B, T, E)
        kernel = runner.decoder_kernel(built, unit.x.query, seen.kernel)
    except MissingPackage as e:
        return [_skip(unit, impl, f"{impl.name} not run: {e}")]
    except Exception as e:
        return [_error(unit, impl, e)]
    judged = [(label, lo, hi, _judge_call(unit, sch, lo, hi, out[:, lo:hi], exact, low, table))
              for label, lo, hi in sch.calls()]
    off = np.zeros(out.shape[:2], bool)
    for label, lo, hi, c in judged:
        if not c.passed:
            off[:, lo:hi] = _off_tokens(out[:, lo:hi], exact.output[:, lo:hi], sch.real(lo, hi), c)
    where = _where_off(sch, off) if off.any() else ""
    first_call = next((label for label, *_, c in judged if not c.passed), None)
    stage = DECODER_STAGES[0] if first_call == "prefill" else DECODER_STAGES[1]
    rows = []
    for label, lo, hi, c in judged:
        message = [_call_note(sch, label, lo, "fed one per call (position -1 on the left padding)"),
                   unit.judged_note(impl)]
        kw = {}
        if not c.passed:
            kw["stage"] = stage
            message += [f"first call off the oracle: {first_call}", where]
        rows.append(unit.row("decode", impl, "oracle", status(c), label, c,
                             message="; ".join(m for m in message if m), kernel=kernel, **kw))
    return rows


def check_decode(unit, impls, peers) -> list[Row]:
    """The decode check of one unit (a decode case in one dtype): ours, the cross-framework runs, every
    decoder among the peers and the user's; the user's other implementations are skip rows."""
    sch = schedule(unit.case.shape)
    rows, runs = [], {}
    for impl in impls:
        if impl.role == "ours":
            rows += _ours(unit, impl, sch, runs)
        elif impl.decode:
            rows += _decoder(unit, impl, sch)
        else:
            rows.append(_skip(unit, impl, f"{impl.name} is not a decoder (decode=False): the decode check runs "
                                          "decoders, fn(p, x_t, cache, position) -> (out, cache); the forward and "
                                          "gradient checks judge it"))
    rows += _cross(unit, sch, runs)
    for peer in peers:
        if peer.decode:
            rows += _decoder(unit, peer, sch)
    return rows


__all__ = ["check_decode", "schedule", "Schedule", "tokens_problem", "MIN_TOKENS", "DECODE_STAGES", "DECODER_STAGES", "STEPS",
           "STARTS", "CHUNK_DECODER_SKIP"]
