"""Packed micro-batches: sequences laid into rows without attending across their boundaries, each
group's shared prompt computed once, micro-batches formed by a token budget (torch only).

A *segment* is what one attention block holds: one sequence (``packing=sequences``), or a whole
group of sequences that share their prompt (``packing=shared_prompt``): the prompt once, then each
response after it. Each response token attends to the prompt and to earlier tokens of its own
response only, and every token keeps the position it has in its own unpacked sequence (responses
continue from the prompt's last position), so hidden states equal those of the unpacked forward:
the packing is exact, not an approximation (the "shared-prefix" forward of some GRPO trainers).

Segments are placed first-fit-decreasing into rows as long as the longest segment, rows into
micro-batches while rows x width stays within the token budget. A group whose prompt and responses
exceed the budget is cut into several segments, each with its own copy of the prompt, so the
attention block (quadratic in its length) stays bounded by the budget for long responses. ``Packed.source`` maps every
scored token of the original [n, S] rows to the flat index of the packed hidden state that
predicts it (the position of its predecessor), so log-probs come back in the unpacked layout and
everything downstream (objectives, aggregation, metrics) is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from learner.config import Packing


@dataclass(frozen=True)
class Packed:
    """One micro-batch's packed forward input."""

    input_ids: torch.Tensor
    """[R, W] int64 packed token ids (padding: any id)."""
    position_ids: torch.Tensor
    """[R, W] int64 each token's position in its own unpacked sequence."""
    attention_mask: torch.Tensor
    """[R, 1, W, W] bool, True where attention is *masked* (megatron's convention)."""
    source: torch.Tensor
    """[n, S] int64 flat index into [R * W] of the hidden state that predicts token (i, t) of the
    original rows (the position of token t - 1); -1 at position 0 and past each sequence's end."""
    real_tokens: int
    """Slots that hold a token (the rest of the R x W slots is padding)."""

    @property
    def tokens(self) -> int:
        """Token slots the forward computes (padding included)."""
        return self.input_ids.numel()


@dataclass(frozen=True)
class _Segment:
    """Rows packed together as one attention block (see the module docstring)."""

    rows: tuple[int, ...]
    """Rows of the micro-batch (indices into its [n, S] tensors) in this segment."""
    prompt: int
    """Leading tokens the rows share and the segment holds once (0: nothing shared)."""
    size: int
    """Packed tokens: prompt + every row's remainder."""


def segments(
    input_ids: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor | None, packing: Packing, token_budget: int | None = None
) -> list[_Segment]:
    """Split rows into segments: under ``shared_prompt``, consecutive rows with the same prompt
    (same length, same ids) form one, cut into several (each with its own copy of the prompt)
    where prompt + responses would exceed ``token_budget``; a row with nothing scored (length 0)
    is a segment of its own and does not interrupt the run. Every row is its own otherwise."""
    lens = [int(x) for x in lengths]
    if packing != "shared_prompt" or prompt_lengths is None:
        return [_Segment((i,), 0, lens[i]) for i in range(len(lens))]
    plens = [int(x) for x in prompt_lengths]
    out: list[_Segment] = []
    run: list[int] = []
    for i in range(len(lens)):
        if lens[i] == 0:
            out.append(_Segment((i,), 0, 0))
            continue
        if run and not (plens[i] == plens[run[0]] and torch.equal(input_ids[i, : plens[i]], input_ids[run[0], : plens[i]])):
            out += _shared(run, plens[run[0]], lens, token_budget)
            run = []
        run.append(i)
    if run:
        out += _shared(run, plens[run[0]], lens, token_budget)
    return out


def _shared(rows: list[int], prompt: int, lens: list[int], token_budget: int | None) -> list[_Segment]:
    """Rows sharing a ``prompt``-token prefix as segments of at most ``token_budget`` tokens (a
    single row may exceed it); a lone row, or a prefix of 0 tokens, shares nothing."""
    if prompt == 0:
        return [_Segment((r,), 0, lens[r]) for r in rows]
    out, part, size = [], [], prompt
    for r in rows:
        extra = lens[r] - prompt
        if part and token_budget is not None and size + extra > token_budget:
            out.append(part)
            part, size = [], prompt
        part.append(r)
        size += extra
    out.append(part)
    return [_Segment(tuple(p), prompt, prompt + sum(lens[r] - prompt for r in p)) if len(p) > 1 else _Segment(tuple(p), 0, lens[p[0]]) for p in out]


def plan(segs: list[_Segment], token_budget: int) -> list[list[list[_Segment]]]:
    """Micro-batches as lists of rows, each row a list of segments (first-fit decreasing; a
    segment longer than the budget gets a micro-batch of its own)."""
    width = max(1, max(s.size for s in segs))
    rows: list[list[_Segment]] = []
    fill: list[int] = []
    for seg in sorted(segs, key=lambda s: -s.size):
        for r, used in enumerate(fill):
            if used + seg.size <= width:
                rows[r].append(seg)
                fill[r] += seg.size
                break
        else:
            rows.append([seg])
            fill.append(seg.size)
    per_micro = max(1, token_budget // width)
    return [rows[i : i + per_micro] for i in range(0, len(rows), per_micro)]


def pack(input_ids: torch.Tensor, lengths: torch.Tensor, rows: list[list[_Segment]], pad_id: int = 0) -> Packed:
    """The packed forward input of the rows ``input_ids`` [n, S] (segments name rows by index)."""
    width = max(1, max(sum(s.size for s in row) for row in rows))
    n, seq = input_ids.shape
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    seg_of = torch.full((len(rows), width), -1, dtype=torch.long)
    branch = torch.zeros((len(rows), width), dtype=torch.long)
    where = torch.full((n, seq), -1, dtype=torch.long)  # flat packed index of each original token
    seg_no = 0
    for r, row in enumerate(rows):
        off = 0
        for seg in row:
            if seg.prompt:
                p = seg.prompt
                first = seg.rows[0]
                ids[r, off : off + p] = input_ids[first, :p]
                pos[r, off : off + p] = torch.arange(p)
                seg_of[r, off : off + p] = seg_no
                for row_i in seg.rows:
                    where[row_i, :p] = r * width + off + torch.arange(p)
                off += p
            for b, row_i in enumerate(seg.rows, start=1):
                start, end = seg.prompt, int(lengths[row_i])
                k = end - start
                ids[r, off : off + k] = input_ids[row_i, start:end]
                pos[r, off : off + k] = torch.arange(start, end)
                seg_of[r, off : off + k] = seg_no
                branch[r, off : off + k] = b
                where[row_i, start:end] = r * width + off + torch.arange(k)
                off += k
            seg_no += 1
    source = torch.full((n, seq), -1, dtype=torch.long)
    source[:, 1:] = where[:, :-1]
    source[where < 0] = -1  # past a sequence's end nothing is predicted
    return Packed(ids, pos, _mask(seg_of, branch), source, int((seg_of >= 0).sum()))


def _mask(seg_of: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """True where query i must not see key j: j later than i, another segment, or another
    response of the same segment (the shared prompt, branch 0, is seen by all of them)."""
    width = seg_of.shape[1]
    later = torch.triu(torch.ones(width, width, dtype=torch.bool), diagonal=1)
    same_seg = seg_of[:, :, None] == seg_of[:, None, :]
    visible_branch = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    return (later | ~same_seg | ~visible_branch)[:, None]


def unpacked(input_ids: torch.Tensor, response_mask: torch.Tensor | None = None) -> Packed:
    """The plain layout: each row its own sequence, causal attention, every position scored;
    ``response_mask`` (optional) only counts the real tokens (``real_tokens``)."""
    n, seq = input_ids.shape
    real = n * seq if response_mask is None else int(spans(response_mask.cpu())[1].sum())
    source = (torch.arange(n)[:, None] * seq + torch.arange(seq)[None] - 1).clone()
    source[:, 0] = -1
    later = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    return Packed(input_ids, torch.arange(seq)[None].expand(n, seq), later, source, real)


def spans(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: where its scored tokens begin (the prompt length) and end (last + 1); 0 and 0 for
    a row with none. Tokens after the last scored one are never needed (they predict nothing
    scored); a prefix is shared only where the ids are equal, so this is exact for any mask."""
    n, seq = response_mask.shape
    idx = torch.arange(seq).expand(n, seq)
    any_ = response_mask.any(dim=1)
    first = torch.where(response_mask, idx, seq).amin(dim=1)
    last = torch.where(response_mask, idx, -1).amax(dim=1) + 1
    return torch.where(any_, first, 0), torch.where(any_, last, 0)


def micro_batches(input_ids: torch.Tensor, response_mask: torch.Tensor, packing: Packing, token_budget: int) -> list[tuple[list[int], Packed]]:
    """Every row of the batch in exactly one packed micro-batch: (its rows, its forward input)."""
    prompt, lengths = spans(response_mask)
    segs = segments(input_ids, lengths, prompt, packing, token_budget)
    out = []
    for rows in plan(segs, token_budget):
        row_ids = sorted(r for row in rows for seg in row for r in seg.rows)
        out.append((row_ids, pack(input_ids[row_ids], lengths[row_ids], _renumber(rows, row_ids))))
    return out


def _renumber(rows: list[list[_Segment]], row_ids: list[int]) -> list[list[_Segment]]:
    """Segments naming rows by their index within the micro-batch's own tensors."""
    local = {r: i for i, r in enumerate(row_ids)}
    return [[_Segment(tuple(local[r] for r in s.rows), s.prompt, s.size) for s in row] for row in rows]
