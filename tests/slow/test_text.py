"""The server's tokenizer path (tokenizers + jinja2) gives transformers' chat ids."""

from dspark.models.loading import cache_dir, load_target
from dspark.orchestrator.text import ChatTokenizer
from dspark.prompts import eval_prompts


def test_chat_ids_and_decode_match_transformers():
    loaded = load_target()
    tok = ChatTokenizer(cache_dir() / "smollm2-135m-instruct")
    prompts = [p for n in ("gsm8k-test", "humaneval", "mt-bench") for p in eval_prompts(n, 3)]
    for p in prompts + ["héllo 🌍 <tag> \\n\\t  spaces"]:
        ids = tok.chat_ids(p)
        assert ids == loaded.chat_ids(p)
        assert tok.decode(ids[5:40]) == loaded.decode(ids[5:40])
