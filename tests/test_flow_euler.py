"""What only flow_euler has (DESIGN.md section 2.2): the functional reference
is the reference module's program, and a NaN stays in its row (the rows of
the batch are independent trajectories).

The contract it shares with the other ops (reference match at sizes that
reach every CUDA path, float32 accuracy, layouts, opcheck, autograd,
determinism, bad inputs, CUDA streams and graphs) is test_contract.py's,
over op_cases.FLOW_EULER; the kernel paths by name are test_cuda_paths.py's.
"""

import pytest
import torch

import fused_ops
from fused_ops import reference
from fused_test_utils import make_flow_args
from op_cases import CASES

OP = torch.ops.fused_ops.flow_euler.default


def test_functional_reference_is_the_module():
    # reference.flow_euler must be the module's program, bit for bit.
    module = reference.FlowODE(7, 5)
    x = torch.randn(4, 7)
    l1, l2, l3 = module.velocity[0], module.velocity[2], module.velocity[4]
    got = reference.flow_euler(x, l1.weight, l1.bias, l2.weight, l2.bias, l3.weight, l3.bias, 5)
    assert torch.equal(got, module(x))


def test_nan_propagates_per_row(device):
    args = make_flow_args(40, 4, 20, device=device)
    args[0][3, 1] = float("nan")
    got = OP(*args, 2)
    assert torch.isnan(got[3]).all()
    ok = torch.ones(40, dtype=torch.bool)
    ok[3] = False
    assert torch.isfinite(got[ok]).all()


@pytest.mark.parametrize("steps", [True, False])
def test_bool_num_steps_refused(steps, device):
    # A bool is an int to Python and to the schema (True would run one step):
    # the Python functions refuse it, forward and backward.
    case = CASES["flow_euler"]
    size = (3, 4, 9, 2)
    args = case.inputs(size, device=device)
    with pytest.raises(TypeError, match=rf"num_steps must be an int .*got the bool {steps}"):
        fused_ops.flow_euler(*args, steps)
    grad_x = torch.ones_like(args[0])
    with pytest.raises(TypeError, match=rf"num_steps must be an int .*got the bool {steps}"):
        fused_ops.ops.flow_euler_backward(grad_x, *args, steps)
