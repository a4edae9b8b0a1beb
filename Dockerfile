# pipe on NVIDIA's PyTorch container, which already ships torch, Transformer Engine and flash-attn.
# The package is installed without dependencies first, then only the pure-Python dependencies the
# container lacks, so the container's torch and TE are never replaced by PyPI builds. The
# container's /etc/pip/constraint.txt stays in force.
FROM nvcr.io/nvidia/pytorch:25.09-py3

WORKDIR /opt/pipe
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY scripts ./scripts

RUN pip install --no-cache-dir --no-deps -e . \
 && pip install --no-cache-dir click tokenizers tiktoken sentencepiece safetensors zstandard \
        datasets tqdm \
 && python -c "import torch, pipeline; print('torch', torch.__version__)" \
 && pipe --help > /dev/null

ENTRYPOINT ["pipe"]
