"""Stage 01 --regenerate's answer cache (eagle3pipe/prepare/regenerate.py): an answer is reused only for the conversation it
answered. Keyed by record id and turn alone, two records sharing an id (or a record edited between runs) took each
other's answers on a rerun."""
import json
from types import SimpleNamespace

from eagle3pipe.prepare import regenerate


def _conv(question):
    return [{"role": "user", "content": question}, {"role": "assistant", "content": "(the dataset's answer)"}]


def test_records_sharing_an_id_keep_their_own_answers_on_a_rerun(tmp_path):
    args = SimpleNamespace(model_path=str(tmp_path / "model"), regen_temperature=0.0, regen_max_tokens=64, seed=0,
                           max_seq_len=512, dtype="float32", trust_remote_code=False, regen_engine="vllm",
                           regen_samples=1)
    settings = regenerate.settings_of(args)
    france, primes = _conv("What is the capital of France?"), _conv("Name three prime numbers.")
    # what an earlier run of the same settings wrote: one answer each, both records with the id "1"
    with open(tmp_path / "regenerated.jsonl", "w") as f:
        for conv, text in ((france, "Paris."), (primes, "2, 3 and 5.")):
            f.write(json.dumps({"id": "1", "turn": 0, "prompt": regenerate.prompt_digest(conv[:1]), "text": text,
                                "settings": settings}) + "\n")
        # a line of a version that keyed by id and turn only: never trusted
        f.write(json.dumps({"id": "1", "turn": 0, "text": "an answer to something", "settings": settings}) + "\n")
    kept, counts, answers = regenerate.run([("1", france, None), ("1", primes, None)], None, args, str(tmp_path))
    assert [m[1]["content"] for _, m, _ in kept] == ["Paris.", "2, 3 and 5."]
    assert counts["turns_from_cache"] == 2 and counts["turns_regenerated"] == 0
    assert {a["prompt"] for a in answers} == {regenerate.prompt_digest(france[:1]), regenerate.prompt_digest(primes[:1])}
    # an edited record (same id, another question) is not answered from the cache: it would go to the engine
    cache = regenerate.load_cache([str(tmp_path / "regenerated.jsonl")], settings)
    assert ("1", 0, regenerate.prompt_digest(_conv("What is 2 + 2?")[:1])) not in cache and len(cache) == 2
