"""The README's main job: every example, eager vs backend="tpu", with compile and cache-hit counts."""
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpt2  # noqa: E402
import mlp  # noqa: E402
import sd3  # noqa: E402

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    out_dir = os.environ.get("TPU_DYNAMO_EXAMPLES_OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    mlp.main()
    gpt2.main()
    sd3.main(os.path.join(out_dir, "sd3_tiny.png"))
