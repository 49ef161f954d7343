"""The server's tokenizer path (tokenizers + jinja2) gives transformers' chat ids."""

from dspark.models.loading import cache_dir, load_target
from dspark.orchestrator.text import ChatTokenizer
from dspark.paths import shared_dir
from dspark.prompts import first_turn


def test_chat_ids_and_decode_match_transformers():
    loaded = load_target()
    tok = ChatTokenizer(cache_dir() / "smollm2-135m-instruct")
    data = shared_dir() / "data" / "eval"
    prompts = [
        first_turn(data / f"{n}.jsonl", i) for n in ("gsm8k-test", "humaneval", "mt-bench") for i in range(3)
    ]
    for p in prompts + ["héllo 🌍 <tag> \\n\\t  spaces"]:
        ids = tok.chat_ids(p)
        assert ids == loaded.chat_ids(p)
        assert tok.decode(ids[5:40]) == loaded.decode(ids[5:40])
