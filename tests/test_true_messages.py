"""Refusals say the true thing: the argument that is wrong, its value, and what the destination really is.

* A ``block_size`` whose elements do not fill whole bytes is named as ``block_size`` with its own value, not as
  the tensor's ``k`` (which is fine), in the reference and the Triton twin of ``quantize_mx`` and for every
  element format it applies to; a ``k`` that does not pack is named as ``k``.
* A destination the writer refuses is described as what it is: a file, a FIFO, a folder that is not an mxlib
  checkpoint, or a symbolic link (to a checkpoint, a folder, a file or nothing), through ``atomic_folder`` (every
  writer) and the ``dummy-from-config`` command.
"""

import os

import pytest
import torch

from mxlib import reference as R
from mxlib.checkpoints.files.atomic_write import atomic_folder, describe_destination
from mxlib.formats import get_element_format
from mxlib.kernels import quant as K

FP6 = ["e2m3", "e3m2"]


@pytest.mark.parametrize("impl", [R.quantize_mx, K.quantize_mx], ids=["reference", "triton"])
@pytest.mark.parametrize("element", FP6)
@pytest.mark.parametrize("k", [12, 8, 64])
def test_a_block_size_that_does_not_pack_is_named_as_block_size(impl, element, k):
    x = torch.randn(3, k)
    with pytest.raises(ValueError) as err:
        impl(x, element, 2)
    assert str(err.value) == (
        f"{element}: block_size=2 elements do not fill whole bytes; block_size must be a multiple of 4 (6-bit elements)"
    )


@pytest.mark.parametrize("element,k,multiple", [("e2m1", 3, 2), ("e2m3", 6, 4), ("e3m2", 5, 4)])
def test_a_k_that_does_not_pack_is_named_as_k(element, k, multiple):
    bits = get_element_format(element).nbits
    with pytest.raises(ValueError) as err:
        R.pack_codes(torch.zeros(2, k, dtype=torch.uint8), element)
    assert str(err.value) == (
        f"{element}: k={k} elements do not fill whole bytes; k must be a multiple of {multiple} ({bits}-bit elements)"
    )


@pytest.fixture
def places(tmp_path):
    ckpt = tmp_path / "ckpt"
    with atomic_folder(ckpt) as tmp:
        (tmp / "a.bin").write_text("x")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "mine.txt").write_text("mine")
    (tmp_path / "file").write_text("1")
    os.mkfifo(tmp_path / "fifo")
    for name, target in [("to_ckpt", "ckpt"), ("to_folder", "folder"), ("to_file", "file"), ("dangling", "none")]:
        (tmp_path / name).symlink_to(tmp_path / target)
    return tmp_path


WHAT = {
    "file": "a file",
    "fifo": "a FIFO",
    "folder": "a folder that is not an mxlib checkpoint",
    "to_ckpt": "a symbolic link to {p}/ckpt (an mxlib checkpoint; overwrite=True replaces the link itself",
    "to_folder": "a symbolic link to {p}/folder (a folder that is not an mxlib checkpoint; overwrite=True",
    "to_file": "a symbolic link to {p}/file (a file; overwrite=True",
    "dangling": "a symbolic link to {p}/none (nothing: a dangling link; overwrite=True",
}


@pytest.mark.parametrize("name", sorted(WHAT))
def test_a_refused_destination_is_described_as_what_it_is(places, name):
    want = WHAT[name].format(p=places)
    assert describe_destination(places / name).startswith(want)
    before = sorted(os.listdir(places))
    with pytest.raises(FileExistsError) as err:
        with atomic_folder(places / name) as tmp:
            (tmp / "b.bin").write_text("y")
    assert str(err.value).startswith(f"{places / name}: the destination is {want}")
    assert sorted(os.listdir(places)) == before  # refused before anything was written
    assert describe_destination(places / "ckpt") == "an mxlib checkpoint"


def test_a_link_to_a_checkpoint_is_replaced_only_with_overwrite_and_its_target_kept(places):
    with atomic_folder(places / "to_ckpt", overwrite=True) as tmp:
        (tmp / "b.bin").write_text("y")
    assert not (places / "to_ckpt").is_symlink() and (places / "to_ckpt" / "b.bin").read_text() == "y"
    assert (places / "ckpt" / "a.bin").read_text() == "x"  # the link's target is left as it was
