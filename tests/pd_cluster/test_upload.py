"""Step inputs go up in one copy: packing and unpacking keep every array's values, dtype and
shape (empty ones too), on the CPU and, with a GPU, through pinned memory to the device."""
import numpy as np
import pytest
import torch

from pd_cluster.upload import pack, unpack, upload_many

ARRAYS = [np.arange(5, dtype=np.int64) - 2, np.array([], dtype=np.int64),
          np.arange(3, dtype=np.int32) * 7, np.arange(12, dtype=np.int32).reshape(3, 4),
          np.array([0.5, -1.0], dtype=np.float32), np.array([-1], dtype=np.int64)]


def assert_same(tensors: list[torch.Tensor]) -> None:
    for a, t in zip(ARRAYS, tensors, strict=True):
        assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
        assert np.array_equal(t.cpu().numpy(), a)


def test_pack_then_unpack_keeps_each_array():
    packed, offsets = pack(ARRAYS)
    assert all(at % 8 == 0 for at in offsets)        # int64 views need aligned offsets
    assert_same(unpack(packed, ARRAYS, offsets))


@pytest.mark.gpu
def test_upload_many_to_the_gpu_keeps_each_array():
    tensors = upload_many(ARRAYS, torch.device("cuda"))
    assert all(t.is_cuda for t in tensors)
    assert_same(tensors)
