"""tico 0.3.0 converting an HF model end to end, as a user would (run by bench/convert.py
with the tico venv's python; not importable from circleops).

    python bench/_tico_convert.py MODEL_DIR_OR_CONFIG OUT.circle SEQ_LEN
"""
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402
import transformers  # noqa: E402
import tico  # noqa: E402

source, out, seq_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
if source.endswith(".json"):
    config = transformers.AutoConfig.from_pretrained(source)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
model.config.use_cache = False
model.config._attn_implementation = "eager"
model.eval()


class Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids=input_ids, use_cache=False).logits


ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    circle = tico.convert(Logits(model).eval(), (ids,), strict=False)
circle.save(out)
print(f"tico: {time.perf_counter() - t0:.2f} s", file=sys.stderr)
