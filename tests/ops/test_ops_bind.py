"""``OpSpec.bind``: the one place a fused op's call is matched to its schema (the lowering
and the custom op's kernel/fake wrappers both go through ops._common.bind)."""
import pytest
import torch

from circleops.ops import BUILTINS, REGISTRY


@pytest.mark.parametrize("name", BUILTINS)
def test_bind_names_every_argument_and_fills_the_schema_defaults(name):
    spec = REGISTRY[name]
    schema = spec.overload._schema
    required = [a for a in schema.arguments if not a.has_default_value()]
    args, _ = spec.sample_inputs(torch.float32)[0]
    args = tuple(args[:len(required)])  # only what has no default: the rest must come from the schema
    bound = spec.bind(args, {})
    assert list(bound) == [a.name for a in schema.arguments]
    for a in schema.arguments[len(args):]:
        assert bound[a.name] == a.default_value, a.name
    if len(schema.arguments) > len(args):  # a keyword wins over the default
        last = schema.arguments[-1]
        assert spec.bind(args, {last.name: "given"})[last.name] == "given"


def test_bind_refuses_a_missing_required_argument():
    spec = REGISTRY["rms_norm"]
    with pytest.raises(TypeError, match="missing required argument"):
        spec.bind((), {})
