"""BatchLayout: which request and branch each forward row is, and the per-row host facts it hands out."""
from __future__ import annotations

import pytest
import torch

from dvllm.models.layout import BatchLayout


def layout(**kw) -> BatchLayout:
    # requests: a (2 images, CFG), b (1 image, CFG), c (1 image, no CFG)
    return BatchLayout(image_size=(32, 48), counts=(2, 1, 1), num_cfg_requests=2, guidance=(5.0, 3.0, 1.0),
                       text_lengths=((3, 4), (5, 6), (7, 7)), **kw)


def test_rows_are_each_requests_images_then_the_cfg_requests_again():
    lay = layout()
    assert (lay.num_cond, lay.num_cfg, lay.num_rows) == (4, 3, 7)
    assert lay.bounds == ((0, 2), (2, 3), (3, 4))
    assert lay.row_request == (0, 0, 1, 2, 0, 0, 1)
    assert lay.row_negative == (False,) * 4 + (True,) * 3
    assert lay.request_rows(0) == ([0, 1], [4, 5])
    assert lay.request_rows(2) == ([3], [])
    assert lay.row_text_lengths == (3, 3, 5, 7, 4, 4, 6)  # the negative prompt's length on its rows
    assert lay.per_row(lay.guidance) == [5.0, 5.0, 3.0, 1.0, 5.0, 5.0, 3.0]
    x = torch.arange(4)
    assert lay.lay_out(None, x).tolist() == [0, 1, 2, 3, 0, 1, 2]
    buffer = torch.full((9,), -1)  # a graph's static input: written in place, padding rows copy the last row
    assert lay.padded(9).lay_out(buffer, x) is buffer and buffer.tolist() == [0, 1, 2, 3, 0, 1, 2, 2, 2]


def test_padding_repeats_the_last_row():
    lay = layout().padded(8)
    assert lay.num_rows == 8 and lay.row_request[-1] == 1 and lay.row_negative[-1]
    assert lay.row_text_lengths[-1] == 6
    assert layout().padded(7) == layout()
    with pytest.raises(ValueError, match="cannot pad 7 rows to 6"):
        layout().padded(6)


def test_adapters_and_grids_follow_their_requests():
    lay = layout(loras=((), ((7, 0.5),), ()), image_grids=((2, 2), (4, 2, 2, 2), (2, 2)))
    assert lay.row_loras == ((), (), ((7, 0.5),), (), (), (), ((7, 0.5),))
    assert lay.row_grids[2] == (4, 2, 2, 2) and lay.row_grids[6] == (4, 2, 2, 2)
    assert layout(loras=((), (), ())).row_loras == ()  # no adapters anywhere: nothing to apply


def test_a_single_layout_is_independent_rows():
    lay = BatchLayout.single((16, 16), 3)
    assert lay.num_rows == 3 and lay.num_cfg == 0 and lay.row_text_lengths is None and lay.row_loras == ()
