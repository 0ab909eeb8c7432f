r"""A convolution's input factor without unfolding its patches: the image correlated with itself, shifted.

K-FAC's input factor of a Conv2d is ``A = 1/M Σ ā āᵀ`` over its ``M = N·H_out·W_out`` kernel patches
(:mod:`labkit.optim.kfac.layers`). Unfolding the patches copies every pixel ``kh·kw`` times, and their
product costs ``(C·kh·kw)²·M`` multiply-adds: for a 3x3 convolution, 81 C×C products per output position,
more than the convolution's own forward and backward passes. But neighbouring patches overlap. For stride 1
and dilation 1, the C×C block of ``A`` between kernel offsets ``o = (i, j)`` and ``o' = (i', j')`` is

    Σ_A[o, o'] = Σ_n Σ_{p ∈ R(o)} x_p x_{p+δ}ᵀ,    δ = o' − o,    R(o) = [i, i + H_out) × [j, j + W_out)

(in the padded image's coordinates): the image correlated with itself shifted by ``δ``, summed over the
window ``R(o)`` of anchor pixels. A block depends on its offsets only through ``δ`` and the window, and
``Σ_A[o', o] = Σ_A[o, o']ᵀ``, so one half of the ``(2kh−1)(2kw−1)`` shifts is enough: those with
``dy > 0``, or ``dy = 0`` and ``dx ≥ 0`` (:func:`half_shifts`, D of them: 13 for 3x3, 41 for 5x5).

**Many channels: pixels.**

1. **Every anchor.** ``F_δ = Σ_p x_p x_{p+s}ᵀ`` over the whole padded image, flattened over (sample, row,
   column), against itself ``s = dy·W + dx`` places on: one matrix product on two views, no copy. The
   padding on a row's right is the next row's left padding (``W = W_in + p_w``), and a sample's bottom padding
   the next sample's top, so the zeros are stored once.
2. **Minus the anchors outside the window.** They all lie in the *frame* outside the core
   ``∩_o R(o) = [kh−1, H_out) × [kw−1, W_out)``. Its real (not padding) pixels are grouped by class: the row
   (or "a middle row") and the column (or "a middle column"), so that a window holds a class whole or not at
   all. Each class's ``Σ x_p x_{p+s}ᵀ`` for every shift is one product (with the ``kh·(2kw−1)`` shifts of
   whole kernel rows, gathered as runs of neighbouring pixels); each window subtracts the classes it leaves out.

A partner ``p + s`` that runs past the end of a row lands on the next row, and past the last sample on zeros.
Anchors inside a window never do (their partners lie inside the window shifted by ``δ``), and step 2 subtracts
exactly what step 1 added for the others, so the result is exact up to the order of summation.

Cost, in multiply-adds, against unfolding's ``(kh·kw·C)²·N·H_out·W_out`` (three quarters of that from
``kh·kw·C = 96`` on, :func:`labkit.optim.kfac.layers.gram`)::

    C²·N·(D·(H_in + p_h)(W_in + p_w) + kh·(2kw−1)·|frame|)

For a 3x3 convolution with padding 1 on a 32x32 image that is ``13·1089 + 15·124 = 16,017`` against
``60.75·1024 = 62,208`` times ``C²·N``.

**Few channels: whole rows.** The products above are C×C, too thin to run fast below :data:`MIN_CHANNELS`
input channels (LeNet has 3 and 6). There the image is unfolded along its width only (``kw`` copies, not
``kh·kw``): row ``r`` of a sample becomes ``W_out`` vectors of ``C·kw`` numbers, and the block of ``A``
between kernel rows ``i`` and ``i' = i + dy`` is ``Σ_{r ∈ [i, i + H_out)} U_rᵀ U_{r+dy}``, a correlation of rows.
One batched product gives every row's product with itself and the ``kh − 1`` rows below, side by side in
memory, so the partners are a view; a running sum over the rows gives every window's block, with no frame to
subtract. Cost ``kh·(C·kw)²·N·H_p·W_out``:
for LeNet's first convolution (5x5, 32x32, no padding) ``5·15²·32·28`` against unfolding's ``75²·28·28``
times N, 4.4 times fewer.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def conv_padding(conv: nn.Conv2d) -> tuple[int, int]:
    """The zero padding ``(rows, columns)`` on each side of the input, ``"valid"`` and ``"same"`` resolved."""
    if conv.padding == "valid":
        return 0, 0
    if conv.padding == "same":
        # total padding d(k-1); PyTorch puts an odd pixel on the right, which symmetric padding cannot express,
        # so K-FAC only accepts "same" when d(k-1) is even (layers.supports)
        return tuple(d * (k - 1) // 2 for k, d in zip(conv.kernel_size, conv.dilation))
    return conv.padding


#: from this many input channels on, pixels are correlated (C×C products); below it, whole rows (C·kw square)
MIN_CHANNELS = 16
#: rows narrower than this many numbers (C·kw): their products are too thin to beat the unfolded patches' one
#: big product (measured, 3x3 on 32x32: 1 channel x 3 is slower correlated, 2 x 3 faster)
MIN_ROW = 6


def applies(conv: nn.Conv2d) -> bool:
    """On the CPU, stride 1 and dilation 1 (the patches are the image's windows shifted by one pixel), and either
    :data:`MIN_CHANNELS` input channels or rows of at least :data:`MIN_ROW` numbers.

    A GPU runs the unfolded patches' one big product near its peak, and the tens of small products and gathers
    here would be launch-bound, so a convolution on a GPU unfolds (the choice is not measured on a GPU).
    """
    return (conv.weight.device.type == "cpu" and tuple(conv.stride) == (1, 1) and tuple(conv.dilation) == (1, 1)
            and (by_pixels(conv) or conv.in_channels * conv.kernel_size[1] >= MIN_ROW))


def by_pixels(conv: nn.Conv2d) -> bool:
    """Whether :func:`conv_input_covariance` correlates pixels (at least :data:`MIN_CHANNELS` input channels)
    rather than rows."""
    return conv.in_channels >= MIN_CHANNELS


@lru_cache(maxsize=None)
def half_shifts(kh: int, kw: int) -> tuple[tuple[int, int], ...]:
    """The shifts ``δ = (dy, dx)`` with ``dy > 0``, or ``dy = 0`` and ``dx ≥ 0``: ``kh·(2kw−1) − (kw−1)`` of them."""
    return tuple((dy, dx) for dy in range(kh) for dx in range(1 - kw, kw) if dy > 0 or dx >= 0)


@lru_cache(maxsize=None)
def _assembly(kh: int, kw: int) -> tuple[Tensor, Tensor, Tensor]:
    """For each pair of kernel offsets ``(o, o')`` (row-major, o first): the index of its shift in
    :func:`half_shifts`, the offset whose window anchors it, and whether the block is that shift's transpose."""
    index = {s: k for k, s in enumerate(half_shifts(kh, kw))}
    offsets = [(i, j) for i in range(kh) for j in range(kw)]
    shift, window, flip = [], [], []
    for o, (i, j) in enumerate(offsets):
        for o2, (i2, j2) in enumerate(offsets):
            forward = (i2 - i, j2 - j) in index
            shift.append(index[(i2 - i, j2 - j)] if forward else index[(i - i2, j - j2)])
            window.append(o if forward else o2)
            flip.append(not forward)
    return torch.tensor(shift), torch.tensor(window), torch.tensor(flip)


def _edge_class(position: Tensor, low: int, high: int) -> Tensor:
    """A row's (column's) class: itself if it is outside ``[low, high)``, where some window ends, else -1."""
    return torch.where((position < low) | (position >= high), position, torch.full_like(position, -1))


def conv_input_covariance(x: Tensor, conv: nn.Conv2d, bias: bool) -> Tensor:
    """``1/M Σ ā āᵀ`` of the kernel patches of ``x`` (N, C, H, W) for a stride-1, dilation-1 ``conv``:
    (C·kh·kw + bias, C·kh·kw + bias), rows in the order of ``conv.weight.reshape(C_out, -1)``, the bias last.

    Equal, up to the order of summation, to ``input_covariance(conv_patches(x, conv), bias)``; the algorithms
    are in the module docstring.
    """
    kh, kw = conv.kernel_size
    ph, pw = conv_padding(conv)
    n, c, h, w = x.shape
    ho, wo = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
    d = c * kh * kw
    cov = x.new_empty(d + int(bias), d + int(bias))
    cov[:d, :d] = (_pixel_sums if by_pixels(conv) else _row_sums)(x, kh, kw, ph, pw)
    count = n * ho * wo
    if bias:
        summed = F.pad(x.sum(0), (pw, pw, ph, ph))  # (C, H_p, W_p): Σ over samples
        total = summed.unfold(1, ho, 1).unfold(2, wo, 1).sum((-1, -2)).reshape(-1)  # Σ ā per (c, i, j)
        cov[:d, d] = total
        cov[d, :d] = total
        cov[d, d] = count
    return cov.div_(count)


def _row_sums(x: Tensor, kh: int, kw: int, ph: int, pw: int) -> Tensor:
    """``Σ ā āᵀ`` without the bias from rows unfolded along the width (module docstring, few channels)."""
    n, c, h, w = x.shape
    hp, wp = h + 2 * ph, w + 2 * pw
    ho, wo = hp - kh + 1, wp - kw + 1
    e, k, height = c * kw, n * wo, hp + kh - 1
    # channels last, and kh - 1 zero rows below (the last rows' partners): (N, H_p + kh - 1, W_p, C)
    padded = F.pad(x, (pw, pw, ph, ph + kh - 1)).permute(0, 2, 3, 1).contiguous()
    # (N·W_out, rows, kw·C): U_r = rows[:, r] holds row r's (j, c) vectors, each a run of kw·C neighbouring
    # numbers of one image row; rows r … r + kh - 1 lie side by side
    rows = padded.unfold(2, kw, 1).permute(0, 2, 1, 4, 3).reshape(k, height, e)
    anchors = rows.as_strided((hp, e, k), (e, 1, height * e))             # U_rᵀ, one per row r
    partners = rows.as_strided((hp, k, kh * e), (e, height * e, 1))       # [U_r … U_{r+kh-1}]: a view, no copy
    running = torch.bmm(anchors, partners).cumsum(0)                       # Σ_{r' <= r} U_r'ᵀ [U_r' … U_{r'+kh-1}]
    running = torch.cat([running.new_zeros(1, e, kh * e), running])
    blocks = x.new_empty(c, kh, kw, c, kh, kw)
    for i in range(kh):
        window = (running[i + ho] - running[i]).view(kw, c, kh, kw, c)     # rows [i, i + H_out), every dy
        for dy in range(kh - i):
            block = window[:, :, dy].permute(1, 0, 3, 2)                    # (j, c, j', c') -> (c, j, c', j')
            blocks[:, i, :, :, i + dy, :] = block
            if dy:
                blocks[:, i + dy, :, :, i, :] = block.permute(2, 3, 0, 1)
    return blocks.view(c * kh * kw, c * kh * kw)


def _pixel_sums(x: Tensor, kh: int, kw: int, ph: int, pw: int) -> Tensor:
    """``Σ ā āᵀ`` without the bias from pixel correlations and their frame (module docstring, many channels)."""
    n, c, h, w = x.shape
    hp, wp = h + 2 * ph, w + 2 * pw
    ho, wo = hp - kh + 1, wp - kw + 1
    # The layout: a row of C numbers per cell; padded pixel (n, r, col) at cell lead + n·P + r·W + col with
    # W = w + pw and P = (h + ph)·W, so that a row's right padding is the next row's left padding and a sample's
    # bottom padding the next one's top: zeros shared, not repeated.
    row, lead = w + pw, kw - 1
    sample = (h + ph) * row
    shifts = half_shifts(kh, kw)
    steps = [dy * row + dx for dy, dx in shifts]
    end = lead + n * sample + ph * row + pw  # past the last padded pixel
    image = x.new_empty(end + (kh - 1) * row + 2 * (kw - 1), c)
    grid = image[lead:lead + n * sample].view(n, h + ph, row, c)
    grid[:, ph:, pw:] = x.permute(0, 2, 3, 1)
    for padding in (image[:lead], grid[:, :ph], grid[:, ph:, :pw], image[lead + n * sample:]):
        padding.zero_()  # the zeros only, not the whole buffer first

    # 1. every anchor: F_δ = Σ_p x_p x_{p+s}ᵀ, (D, C, C)
    full = torch.stack([image[:end].t() @ image[s:s + end] for s in steps])

    # 2. the frame's real pixels, grouped by (row class, column class); each class's Σ x_p x_{p+s}ᵀ
    rows = torch.arange(hp).repeat_interleave(wp)
    cols = torch.arange(wp).repeat(hp)
    row_class, col_class = _edge_class(rows, kh - 1, ho), _edge_class(cols, kw - 1, wo)
    real = (rows >= ph) & (rows < ph + h) & (cols >= pw) & (cols < pw + w)
    pixels = torch.nonzero(real & ((row_class >= 0) | (col_class >= 0))).squeeze(1)
    corrections = x.new_zeros(kh * kw, len(shifts), c, c)
    if len(pixels):  # else a 1x1 kernel, or a frame of padding only: every window holds every anchor
        key = (row_class[pixels] + 1) * (wp + 1) + col_class[pixels] + 1
        key, order = key.sort(stable=True)
        pixels = pixels[order]
        _, counts = torch.unique_consecutive(key, return_counts=True)
        cells = lead + rows[pixels] * row + cols[pixels]
        at = (cells[:, None] + sample * torch.arange(n)[None, :]).reshape(-1).to(x.device)  # (|frame|·N,)
        anchors = image.index_select(0, at)                                    # (|frame|·N, C)
        # each anchor's partners one row of the kernel's reach at a time: 2kw - 1 neighbouring cells, one
        # contiguous run of numbers, from a view whose rows overlap (dy = 0, dx < 0 come along, unused)
        runs = image.view(-1).unfold(0, (2 * kw - 1) * c, c)
        starts = at[:, None] + torch.arange(kh, device=x.device)[None, :] * row - (kw - 1)
        partners = runs.index_select(0, starts.reshape(-1)).view(len(at), -1)  # (|frame|·N, kh·(2kw-1)·C)
        ends = (counts.cumsum(0) * n).tolist()
        per_class = torch.stack([anchors[a:b].t() @ partners[a:b] for a, b in zip([0] + ends[:-1], ends)])
        per_class = per_class.view(len(counts), c, kh, 2 * kw - 1, c)[
            :, :, [dy for dy, _ in shifts], [dx + kw - 1 for _, dx in shifts]]  # (classes, C, D, C)
        first = counts.cumsum(0) - counts  # each class's first pixel
        cls_row, cls_col = row_class[pixels[first]], col_class[pixels[first]]
        offsets = torch.arange(kh * kw)
        i, j = (offsets // kw)[:, None], (offsets % kw)[:, None]
        inside = (((cls_row < 0) | ((cls_row >= i) & (cls_row < i + ho)))
                  & ((cls_col < 0) | ((cls_col >= j) & (cls_col < j + wo))))  # (kh·kw, classes)
        corrections += ((~inside).to(x.device, x.dtype) @ per_class.view(len(counts), -1)).view(
            kh * kw, c, len(shifts), c).transpose(1, 2)

    # 3. the blocks: F_δ minus its window's outside anchors, transposed for the other half of the shifts
    shift, window, flip = (t.to(x.device) for t in _assembly(kh, kw))  # indices built on the CPU, once
    blocks = full[shift] - corrections[window, shift]  # (kh·kw·kh·kw, C, C)
    blocks = torch.where(flip[:, None, None], blocks.transpose(1, 2), blocks)
    d = c * kh * kw
    return blocks.view(kh * kw, kh * kw, c, c).permute(2, 0, 3, 1).reshape(d, d)
