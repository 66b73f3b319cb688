"""Loaded CPU weights on 2 MiB pages (`weight_pages`): one arena advised for huge pages
holds them, with the same bytes, the same sharing (tied weights, views), and the same
logits as weights left where they were loaded; `HYDRA_JURY_HUGE_PAGES=off` leaves them."""

from __future__ import annotations

import mmap
import re
import weakref
from pathlib import Path

import pytest
import torch

from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.weight_pages import HUGE_PAGE, VARIABLE, place_on_huge_pages
from tests.models import next_token_logits

needs_huge_pages = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE") or not Path("/proc/self/smaps").exists(),
    reason="huge-page advice is Linux's",
)


def advised_regions() -> list[tuple[int, int]]:
    """This process's mappings advised MADV_HUGEPAGE ("hg" in smaps' VmFlags)."""
    regions, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        header = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if header:
            current = (int(header[1], 16), int(header[2], 16))
        elif line.startswith("VmFlags:") and "hg" in line.split()[1:]:
            regions.append(current)
    return regions


def region_of(tensor: torch.Tensor, regions: list[tuple[int, int]]) -> tuple[int, int] | None:
    address = tensor.data_ptr()
    return next((r for r in regions if r[0] <= address < r[1]), None)


def weights(model: HydraModel) -> list[torch.Tensor]:
    return [*model.trunk.tensors(), *model.heads.tensors()]


@pytest.fixture(scope="module")
def pair(wide_jury_checkpoint) -> tuple[HydraModel, HydraModel]:
    """The same checkpoint loaded with weights left where they were loaded, and moved."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(VARIABLE, "off")
        left = HydraModel.load(wide_jury_checkpoint)
        patch.setenv(VARIABLE, "on")
        moved = HydraModel.load(wide_jury_checkpoint)
    return left, moved


@pytest.fixture(scope="module")
def advised_by_loading_left(wide_jury_checkpoint) -> list[tuple[int, int]]:
    """The mappings advised for huge pages while a load with them off ran."""
    before = set(advised_regions())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(VARIABLE, "off")
        HydraModel.load(wide_jury_checkpoint)
    return [region for region in advised_regions() if region not in before]


@needs_huge_pages
def test_every_weight_moves_into_one_advised_arena(pair, advised_by_loading_left):
    left, moved = pair
    regions = advised_regions()
    homes = {region_of(t, regions) for t in weights(moved)}
    assert len(homes) == 1 and None not in homes
    # Turned off, a load advises nothing, and none of its weights is in the arena. (Not
    # "in no advised mapping at all": once in a full run, on one xdist worker after many
    # other models had been loaded and freed, a weight of the load turned off was found
    # in an advised mapping that this load had not made.)
    assert advised_by_loading_left == []
    assert all(region_of(t, regions) not in homes for t in weights(left))
    # The arena starts on a huge page: its first weight's address is a multiple of 2 MiB.
    assert min(t.data_ptr() for t in weights(moved)) % HUGE_PAGE == 0


def test_the_bytes_and_the_logits_are_those_of_weights_left_in_place(pair):
    left, moved = pair
    for a, b in zip(weights(left), weights(moved), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
    tokens = [1, 5, 9, 2, 30, 7, 7, 4]
    assert torch.equal(next_token_logits(left, tokens), next_token_logits(moved, tokens))


def test_a_tied_lm_head_still_shares_the_embedding(hydra_checkpoints):
    model = HydraModel.load(hydra_checkpoints["qwen2"])  # tie_word_embeddings
    assert model.heads.shares_lm_head
    assert model.heads.lm_head.data_ptr() == model.trunk.embedding.data_ptr()


@needs_huge_pages
def test_views_and_repeated_tensors_keep_their_sharing():
    base = torch.arange(3000, dtype=torch.float32).reshape(30, 100)
    row_view, column_view = base[7], base[:, 3]  # an offset view and a strided one
    codes = torch.arange(-64, 64, dtype=torch.int8)
    expected = [t.clone() for t in (base, row_view, column_view, codes)]
    size = place_on_huge_pages([base, row_view, column_view, base, codes])
    assert size >= base.nbytes + codes.nbytes
    for tensor, values in zip((base, row_view, column_view, codes), expected, strict=True):
        assert torch.equal(tensor, values)
    assert column_view.stride() == (100,)
    base[7, 3] = -1.0  # one storage still: a write shows through both views
    assert row_view[3] == -1.0 and column_view[7] == -1.0
    regions = advised_regions()
    assert region_of(base, regions) is not None
    assert region_of(base, regions) == region_of(codes, regions)


@needs_huge_pages
def test_the_old_bytes_are_freed_even_under_a_view():
    # safetensors loads each tensor as a view of a flat buffer: the view's base would
    # keep the old bytes alive beside the arena's copy.
    flat = torch.arange(600, dtype=torch.float32)
    weight = flat.view(20, 30)
    old = weakref.ref(flat)
    del flat
    assert old() is not None  # held by the view
    place_on_huge_pages([weight])
    assert old() is None
    assert weight._base is None
    assert torch.equal(weight, torch.arange(600, dtype=torch.float32).view(20, 30))


def test_off_leaves_the_weights_and_a_bad_value_is_refused(monkeypatch):
    tensor = torch.ones(4, 4)
    address = tensor.data_ptr()
    monkeypatch.setenv(VARIABLE, "off")
    assert place_on_huge_pages([tensor]) == 0 and tensor.data_ptr() == address
    monkeypatch.setenv(VARIABLE, "always")
    expected = r"\$HYDRA_JURY_HUGE_PAGES='always': expected one of on, off"
    with pytest.raises(ValueError, match=expected):
        place_on_huge_pages([tensor])


def test_nothing_to_move_makes_no_arena():
    assert place_on_huge_pages([]) == 0
    assert place_on_huge_pages([torch.empty(0)]) == 0
