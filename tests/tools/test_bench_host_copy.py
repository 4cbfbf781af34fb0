"""tools.bench.host_copy: its table, and its errors (the GPU figures come from a GPU session)."""

import numpy as np
import pytest
import torch

from runtime.backends.torch import to_host
from tools.bench import host_copy


def test_the_table_has_a_row_per_shape_and_the_saving_is_their_difference(capsys):
    assert host_copy.main(["--device", "cpu", "--batch", "1", "2", "--vocab", "64", "--rounds", "3"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(1, 64), (2, 64)]
    for r in rows:
        pageable, pinned, saved, ids, ids_saved = (float(x) for x in r[3:])
        assert pageable >= 0 and pinned >= 0 and ids >= 0
        assert saved == pytest.approx(pageable - pinned, abs=2e-3)  # each printed to 3 decimals
        assert ids_saved == pytest.approx(pinned - ids, abs=2e-3)


def test_the_ids_are_the_argmax_of_the_logits():
    logits = torch.randn(3, 17)
    ids = to_host(logits.argmax(-1))
    assert ids.dtype == np.int64
    np.testing.assert_array_equal(ids, logits.numpy().argmax(-1))


def test_on_the_cpu_the_logits_are_the_tensors_own_values():
    logits = torch.randn(3, 17)
    np.testing.assert_array_equal(to_host(logits), logits.numpy())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_without_cuda_it_says_how_to_run_it(capsys):
    with pytest.raises(SystemExit):
        host_copy.main([])
    assert "no CUDA device visible to PyTorch: run it on a GPU, or with --device cpu" in capsys.readouterr().err


def test_sizes_below_one_are_refused(capsys):
    with pytest.raises(SystemExit):
        host_copy.main(["--device", "cpu", "--rounds", "0"])
    assert "--batch, --vocab and --rounds must be >= 1" in capsys.readouterr().err
