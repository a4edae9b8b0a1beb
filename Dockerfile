# pipe on NVIDIA's PyTorch container, which already ships torch, Transformer Engine and flash-attn.
# The package is installed without dependencies first, then only the pure-Python dependencies the
# container lacks, so the container's torch and TE are never replaced by PyPI builds. The
# container's /etc/pip/constraint.txt stays in force.
#
# pipe supports torch 2.11 to 2.13: pick a container release that ships one of them with
# `docker build --build-arg BASE=nvcr.io/nvidia/pytorch:YY.MM-py3 .` (the build stops with a
# one-line message on an older torch).
ARG BASE=nvcr.io/nvidia/pytorch:25.09-py3
FROM ${BASE}

WORKDIR /opt/pipe
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY scripts ./scripts

RUN python -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('.')[:2]); \
sys.exit(0 if (2, 11) <= v < (2, 14) else f'pipe needs torch 2.11 to 2.13; this image has {torch.__version__}: pass --build-arg BASE=...')" \
 && pip install --no-cache-dir --no-deps -e . \
 && pip install --no-cache-dir click tokenizers gigatoken orjson sentencepiece safetensors \
        zstandard datasets tqdm \
 && python -c "import torch, pipeline; print('torch', torch.__version__)" \
 && pipe --help > /dev/null

ENTRYPOINT ["pipe"]
