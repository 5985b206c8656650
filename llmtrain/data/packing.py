"""Examples -> rows of seq_len: input_ids, labels, position_ids.

Packed rows restart position_ids at every example, so transformers builds a block-causal mask
(sdpa/eager/flash) and each example attends only to itself. The first token of every piece gets no
label: nothing before it in its own example predicts it."""

from __future__ import annotations

from llmtrain.data.formats import IGNORE

Rows = dict[str, list[list[int]]]


class RowBuilder:
    def __init__(self, seq_len: int, pad_id: int):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.ids: list[int] = []
        self.labels: list[int] = []
        self.pos: list[int] = []
        self.rows: Rows = {"input_ids": [], "labels": [], "position_ids": []}
        self.truncated = 0

    def flush(self) -> None:
        if not self.ids:
            return
        n = self.seq_len - len(self.ids)
        self.rows["input_ids"].append(self.ids + [self.pad_id] * n)
        self.rows["labels"].append(self.labels + [IGNORE] * n)
        self.rows["position_ids"].append(self.pos + list(range(n)))  # pads: their own ignored segment
        self.ids, self.labels, self.pos = [], [], []

    def _place(self, ids: list[int], labels: list[int]) -> None:
        self.ids += ids
        self.labels += [IGNORE] + labels[1:]
        self.pos += range(len(ids))

    def add(self, ids: list[int], labels: list[int], split: bool) -> None:
        """split=True (text): cut documents across rows, no padding until the end.
        split=False (instruction/chat): whole examples only; a long one is truncated."""
        if split:
            start = 0
            while start < len(ids):
                take = self.seq_len - len(self.ids)
                self._place(ids[start:start + take], labels[start:start + take])
                start += take
                if len(self.ids) == self.seq_len:
                    self.flush()
            return
        if len(ids) > self.seq_len:
            ids, labels = ids[:self.seq_len], labels[:self.seq_len]
            self.truncated += 1
        if len(self.ids) + len(ids) > self.seq_len:
            self.flush()
        self._place(ids, labels)


def to_rows(examples, seq_len: int, pad_id: int, packing: bool) -> tuple[Rows, int]:
    """(ids, labels, split) examples -> rows, greedy and in order, so rows do not depend on the world
    size. packing=False: one example per row, right-padded (real tokens never attend to the pads
    after them). Returns (rows, number of truncated examples)."""
    builder = RowBuilder(seq_len, pad_id)
    for ids, labels, split in examples:
        builder.add(ids, labels, split and packing)
        if not packing:
            builder.flush()
    builder.flush()
    return builder.rows, builder.truncated
