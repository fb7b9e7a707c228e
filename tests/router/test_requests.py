"""Requests as the router reads them: unknown fields refused (or dropped when lenient), every parameter
applied to the plan or refused with a 400 naming it, and chat messages rendered with the checkpoint's template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvwire.router.chat_template import ChatTemplate
from kvwire.router.config import RouterConfig
from kvwire.router.sampling import Limits, chat_plan, completion_plan
from kvwire.router.schemas import APIError, ChatRequest, CompletionRequest, parse_body

LIMITS = Limits(max_model_len=64, vocab_size=300)


def _completion(**body) -> CompletionRequest:
    return parse_body(json.dumps({"prompt": "x", **body}).encode(), CompletionRequest, lenient=False)


def _refused(param: str, **body) -> None:
    with pytest.raises(APIError) as err:
        completion_plan(_completion(**body), [[1, 2]], LIMITS)
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_unknown_fields_refused_by_name_or_dropped_when_lenient():
    body = json.dumps({"prompt": "x", "bogus_param": 1, "also_bogus": 2}).encode()
    with pytest.raises(APIError) as err:
        parse_body(body, CompletionRequest, lenient=False)
    assert err.value.status == 400 and "also_bogus, bogus_param" in err.value.message
    assert parse_body(body, CompletionRequest, lenient=True).prompt == "x"
    with pytest.raises(APIError, match="stream_options"):  # nested objects too, lenient or not
        parse_body(b'{"prompt": "x", "stream": true, "stream_options": {"x": 1}}', CompletionRequest, lenient=True)


def test_plan_applies_every_sampling_parameter():
    req = _completion(max_tokens=9, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.5,
                      frequency_penalty=-0.5, repetition_penalty=1.2, seed=7, stop=["a"], stop_token_ids=[3],
                      ignore_eos=True, min_tokens=2, logprobs=3, n=2, best_of=3, user="u")
    plan = completion_plan(req, [[1, 2], [3]], LIMITS)
    s = plan.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (9, 0.5, 0.9, 5, 0.1)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (s.stop_token_ids, s.ignore_eos, s.min_tokens, s.logprobs) == ([3], True, 2, 3)
    assert plan.stop == ("a",) and (plan.n, plan.best_of) == (2, 3) and len(plan.prompts) == 2
    assert [plan.sampling_for(j).seed for j in range(3)] == [7, 8, 9]


def test_best_of_asks_for_the_sampled_logprobs_only():
    plan = completion_plan(_completion(best_of=2), [[1]], LIMITS)
    assert plan.sampling.logprobs == 0 and plan.logprobs is None


@pytest.mark.parametrize(("param", "body"), [
    ("logit_bias", {"logit_bias": {"5": 1.0}}), ("suffix", {"suffix": "end"}), ("echo", {"echo": True, "logprobs": 1}),
    ("best_of", {"best_of": 1, "n": 2}), ("best_of", {"best_of": 3, "stream": True}), ("logprobs", {"logprobs": 21}),
    ("stream_options", {"stream_options": {"include_usage": True}}), ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": 1.5}), ("repetition_penalty", {"repetition_penalty": 0}), ("stop_token_ids",
    {"stop_token_ids": [300]}), ("min_tokens", {"min_tokens": 20, "max_tokens": 10}), ("n", {"n": 0}),
    ("max_tokens", {"max_tokens": 64}), ("skip_special_tokens", {"skip_special_tokens": False}),
    ("stream_options", {"stream": True, "stream_options": {"continuous_usage_stats": True}}),
])
def test_refusals_name_the_parameter(param, body):
    _refused(param, **body)


def test_null_max_tokens_takes_the_rest_of_the_context():
    assert completion_plan(_completion(max_tokens=None), [[1] * 10], LIMITS).sampling.max_tokens == 54


def test_chat_plan_and_its_refusals():
    def chat(**body):
        raw = {"messages": [{"role": "user", "content": "hi"}], **body}
        return parse_body(json.dumps(raw).encode(), ChatRequest, lenient=False)
    plan = chat_plan(chat(max_tokens=5, max_completion_tokens=7, logprobs=True, top_logprobs=2), [1], LIMITS)
    assert plan.sampling.max_tokens == 7 and plan.logprobs == 2
    assert chat_plan(chat(logprobs=True), [1], LIMITS).logprobs == 0
    for param, body in [("top_logprobs", {"top_logprobs": 2}), ("tools", {"tools": [{"type": "function"}]}),
                        ("response_format", {"response_format": {"type": "json_object"}}),
                        ("tool_choice", {"tool_choice": "required"})]:
        with pytest.raises(APIError) as err:
            chat_plan(chat(**body), [1], LIMITS)
        assert err.value.param == param


def _chat(**body) -> ChatRequest:
    raw = {"messages": [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
           **body}
    return parse_body(json.dumps(raw).encode(), ChatRequest, lenient=False)


def test_chat_template_from_the_checkpoint(tmp_path: Path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"},
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}"}))
    template = ChatTemplate(tmp_path)
    assert template.render(_chat()) == "<s>[system]be brief\n[user]a\nb\n[assistant]"
    assert template.render(_chat(add_generation_prompt=False)).endswith("b\n")


def test_chat_template_file_request_template_and_none(tmp_path: Path):
    with pytest.raises(APIError, match="no chat template") as err:
        ChatTemplate(tmp_path).render(_chat())
    assert err.value.status == 400
    assert ChatTemplate(tmp_path).render(_chat(chat_template="{{ messages | length }}")) == "2"
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(APIError, match="no system role"):
        ChatTemplate(tmp_path).render(_chat())
    with pytest.raises(APIError, match="sandbox|unsafe|access"):  # the sandbox holds
        ChatTemplate(tmp_path).render(_chat(chat_template="{{ ''.__class__.__mro__ }}"))


def test_served_model_names(tmp_path: Path):
    config = RouterConfig(model_dir=tmp_path / "tiny", redis_url="redis://x")
    assert config.serves("tiny") and config.serves(str(tmp_path / "tiny")) and not config.serves("other")
    named = RouterConfig(model_dir=tmp_path / "tiny", redis_url="redis://x", served_model_names=("a", "b"))
    assert named.served_model_name == "a" and named.serves("b") and not named.serves("tiny")
