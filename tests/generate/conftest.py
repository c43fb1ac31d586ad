from generate_fixtures import (smollm2, tiny_circle, tiny_expected, tiny_model, tiny_onert,  # noqa: F401
                               tiny_tflite)
from vlm_fixtures import tiny_vlm_onert  # noqa: F401
