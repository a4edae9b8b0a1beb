"""Decode rows and prompt chunks run as one pass (`Engine(mix_prompts=True)`, the CPU default)
give the tokens of the two passes run apart, for every family, ALiBi's and gpt-oss's sliding
windows and sinks included; latent attention (DeepSeek-V3) keeps the two passes."""

from __future__ import annotations

import pytest

from pipeline.serve.engine.core import Engine
from pipeline.serve.engine.loading import open_generator
from pipeline.serve.engine.sampling import SamplingParams
from tests.serve.test_generation import FAMILIES, PROMPTS, _hf_family
from tests.serve.test_static_decode import SETTINGS, _outputs, _same

pytest.importorskip("transformers")


def _alibi(directory) -> None:
    from tests.convert.test_bloom_mpt import hf_alibi_model

    hf_alibi_model("bloom").save_pretrained(directory)


def _gpt_oss(directory) -> None:
    from tests.convert.test_gpt_oss import _case, _hf_model

    _hf_model(_case(128)[0]).save_pretrained(directory)


BUILDERS = {name: lambda d, name=name: _hf_family(name, d) for name in FAMILIES}
BUILDERS |= {"bloom": _alibi, "gpt_oss": _gpt_oss}


@pytest.fixture(scope="module", params=list(BUILDERS))
def family_model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    BUILDERS[request.param](directory)
    return request.param, open_generator(directory).model


def _staggered(engine: Engine) -> list:
    """Requests arriving while others decode, their prompts in chunks of 5 over several steps."""
    requests = [engine.add(PROMPTS[0], SETTINGS[0])]
    for _ in range(3):
        engine.step()
    requests += [engine.add(p, s) for p, s in zip(PROMPTS[1:], SETTINGS[1:])]
    engine.step()
    longer = PROMPTS[1] * 2
    return requests + [engine.add(longer, SamplingParams(max_new_tokens=6, greedy=True))]


def test_mixed_steps_give_the_tokens_of_separate_passes(family_model) -> None:
    name, model = family_model
    results = []
    for mix in (True, False):
        engine = Engine(model, max_batch=4, block_size=4, prefill_chunk=5, mix_prompts=mix)
        results.append((engine, _outputs(engine, _staggered(engine))))
    (mixed, mine), (apart, theirs) = results
    assert _same(mine, theirs) >= 12 + 11
    assert apart.mixed_steps == 0
    if name == "deepseek_v3":
        assert mixed.mixed_steps == 0  # latent attention reads its cache itself
    else:
        assert mixed.mixed_steps >= 3
