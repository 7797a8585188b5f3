"""CPU tests of :mod:`miles_host.kernels._dsa_triton` under Triton's interpreter (not collected by
itself): run by ``test_dsa.py::test_cpu_kernels_under_the_triton_interpreter``; alone:
``TRITON_INTERPRET=1 python -m pytest tests/kernels/interpreted_dsa.py``."""

from __future__ import annotations

import pytest

from tests.kernels.test_dsa import CASE, assert_kernels_match_reference, paged_case
from tests.plugins.triton_interpret import interpreted_module


@pytest.fixture(scope="module", autouse=True)
def kernels():
    return interpreted_module("miles_host.kernels._dsa_triton")


@pytest.mark.parametrize("index_heads,index_dim,dk,dv", [(16, 16, 24, 12), (4, 40, 20, 16)])
def test_kernels_match_the_reference(index_heads, index_dim, dk, dv):
    # padded indexer heads (4 -> 16 rows) and head dims that are not powers of two
    case = paged_case(**CASE, index_heads=index_heads, index_dim=index_dim, dk=dk, dv=dv)
    assert_kernels_match_reference(case, atol=1e-5)


def test_more_keys_than_one_program_and_more_selected_than_one_iteration():
    case = paged_case(context_lens=[150, 90], num_new=[2, 1], block_size=8, topk=70, seed=3)
    assert_kernels_match_reference(case, atol=1e-5)
