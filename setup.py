"""rlx: sample-efficient RL post-training of language models in JAX."""

import setuptools

INSTALL_REQUIRES = [
    "jax>=0.10,<0.12",
    "flax>=0.12,<0.13",
    "optax>=0.2.5",
    "orbax-checkpoint>=0.11",
    "tensorflow-datasets>=4.9.8",
    "array_record>=0.7",
    "sentencepiece>=0.2",
    "ml-collections>=1.0",
    "absl-py>=2.1",
    "tqdm>=4.66",
    "numpy>=1.26",
    "importlib_resources",  # needed by tensorflow-datasets (etils) without tensorflow
    "safetensors>=0.4",  # Hugging Face weights in and out (rlx.model.hf); never pickle
    "tokenizers>=0.20",  # tokenizer.json (rlx.data.tokenizer)
    "jinja2>=3.1.6",  # chat templates, rendered as transformers does (>=3.1.6: sandbox fixes)
    "matplotlib>=3.8",  # run reports and sweep plots (rlx.report, rlx.sweep); Agg, no display
]

EXTRAS = {
    # tensorboard (no TensorFlow needed): its EventAccumulator cross-checks the event files that
    # rlx.tensorboard writes by hand; rlx itself never imports it.
    # nbclient + nbformat + ipykernel: tests/test_notebooks.py executes the colab/ notebooks.
    # pytest-xdist: the suite runs in two worker processes, one test file each at a time
    # (--dist loadfile keeps a file's module fixtures and compiled programs in one process).
    # filelock: JAX's lock for the compilation cache the tests' subprocesses share (conftest).
    "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "tensorboard>=2.15",
             "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29", "filelock>=3.12"],
    # Reference implementations for the Hugging Face parity tests. torch==2.13.0 is the CPU
    # wheel on the project's machines; a looser pin would pull a multi-GB CUDA build. peft
    # loads the LoRA adapters rlx.export --peft writes (tests/model/test_lora_export.py).
    "parity": ["torch==2.13.0", "transformers>=5.0,<6", "psutil>=5.9", "peft==0.21.2"],
    # experiments/benchmarks/bench_peers.py: TRL's GRPOTrainer.
    "peers": ["trl==1.16.0", "datasets>=3"],
    # experiments/benchmarks/bench_peers.py --peers=tunix: Tunix's GRPOLearner. Its pins move
    # transformers to 5.12 and safetensors to 0.7 in the same environment: install it in a
    # venv of its own (python -m venv; pip install -e ".[parity,peers,tunix]").
    "tunix": ["google-tunix==0.1.7"],
}

setuptools.setup(
    name="rlx",
    version="0.1.0",
    description="Sample-efficient RL post-training of language models in JAX.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["rlx", "rlx.model", "rlx.sampler", "rlx.rl", "rlx.data", "rlx.kernels",
              "rlx.experiments", "rlx.experiments.benchmarks"],
    # kernels/ and experiments/ sit at the top level (the project's layout) and install as
    # rlx.kernels / rlx.experiments, so no top-level package collides with another one.
    package_dir={"rlx": "rlx", "rlx.kernels": "kernels", "rlx.experiments": "experiments"},
    package_data={"rlx.experiments": ["shapes/*/config.json"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
