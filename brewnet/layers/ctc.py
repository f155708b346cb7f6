"""CTC decoding: senlinuc/caffe_ocr's CTCGreedyDecoder (the best class per time step, repeats
merged, blanks dropped), or with a label bottom the fork's edit-distance and line accuracy
(github.com/senlinuc/caffe_ocr at 81642f61ea8f888e360cca30e08e05b7bc6d4556, ctc_decoder_layer)."""
from __future__ import annotations

import torch

from .base import Layer
from .registry import register


@register("CTCGreedyDecoder")
class CTCGreedyDecoder(Layer):
    """caffe_ocr's CTCGreedyDecoder (ctc_decoder_layer.cpp): per sample and step the first class
    of highest score; a class equal to the previous step's (ctc_merge_repeated) or to blank_index
    (negative: the last class; default 0) is dropped.

    Bottom x (T, N, C, ...) (the C values read at each (t, n) are the first C of its row, as
    the fork's offset(t, n)) -> top (N, T, 1, 1): each sample's classes, then -1. With a second
    bottom, labels (N, L, ...) (a label < 0 ends a sample's; blank labels are skipped; each is
    rounded as int(0.5 + v)), the top is instead (1, 2, 1, 1): [1 - mean over samples of
    edit distance / max(len(label), len(decoded)), fraction of samples decoded exactly] (a sample
    with both empty counts as 0 distance but not as exact, as in the fork). No backward.
    """

    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1
    arithmetic = "exact"

    def allow_backward(self, bottom_index):
        return False

    def reshape(self, bottom_shapes):
        x = tuple(bottom_shapes[0])
        if len(x) < 3:
            raise self.fail(f"needs a (T, N, C) bottom, got {x}")
        if len(bottom_shapes) == 2:
            lab = tuple(bottom_shapes[1])
            if len(lab) < 2 or lab[0] != x[1]:
                raise self.fail(f"labels {lab} are not (N, L) for N = {x[1]}")
            return [(1, 2, 1, 1)]
        return [(x[1], x[0], 1, 1)]

    def _blank(self, classes: int) -> int:
        b = self.param.ctc_decoder_param.blank_index
        return classes - 1 if b < 0 else b

    def decode(self, x: torch.Tensor) -> list[list[int]]:
        """Each sample's decoded classes."""
        steps, n, classes = x.shape[:3]
        best = x.detach().reshape(steps, n, -1)[:, :, :classes].argmax(-1)   # first max, as the fork
        prev = torch.cat([torch.full_like(best[:1], -1), best[:-1]])
        keep = best != self._blank(classes)
        if self.param.ctc_decoder_param.ctc_merge_repeated:
            keep &= best != prev
        best, keep = best.t().tolist(), keep.t().tolist()
        return [[c for c, k in zip(row, ks) if k] for row, ks in zip(best, keep)]

    def forward(self, bottoms):
        x = bottoms[0]
        steps, n, classes = x.shape[:3]
        seqs = self.decode(x)
        if len(bottoms) == 1:
            out = torch.full((n, steps), -1.0, dtype=x.dtype)
            for i, s in enumerate(seqs):
                out[i, :len(s)] = torch.tensor(s, dtype=x.dtype)
            return [out.reshape(n, steps, 1, 1).to(x.device)]
        lab = bottoms[1].detach()
        lab = lab.reshape(lab.shape[0], lab.shape[1], -1)[:, :, 0].double().tolist()
        blank = self._blank(classes)
        acc_edit, exact = 0.0, 0
        for row, s in zip(lab, seqs):
            target = []
            for v in row:
                if v < 0:
                    break
                if int(0.5 + v) != blank:
                    target.append(int(0.5 + v))
            if not target and not s:
                continue
            d = edit_distance(target, s)
            acc_edit += d / max(len(target), len(s))
            exact += d == 0
        out = torch.tensor([1 - acc_edit / n, exact / n], dtype=x.dtype, device=x.device)
        return [out.reshape(1, 2, 1, 1)]


def edit_distance(a: list[int], b: list[int]) -> int:
    """Levenshtein distance (CTCDecoderLayer::EditDistance)."""
    row = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        diag, row[0] = row[0], i
        for j in range(1, len(b) + 1):
            diag, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1]))
    return row[-1]
