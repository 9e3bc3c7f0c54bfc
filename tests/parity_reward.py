"""A reward for end-to-end runs of the untrained tiny model (tests/test_async.py's golden
run): a response with an odd number of characters passes, so about half of every group
succeeds and successes, demonstrations and held-out success all appear; a failure gets
feedback, so feedback contexts appear too. `--data.reward tests/parity_reward.py:parity`."""


def parity(response, row, truncated, cut_fails=False):
    """cut_fails (`--data.reward_kwargs '{"cut_fails": true}'`): a response cut at
    --rollout.max_tokens fails, as every task's reward fails it."""
    if cut_fails and truncated:
        return {"score": 0.0, "feedback": "The answer was cut off before it ended."}
    if len(response) % 2:
        return {"score": 1.0, "feedback": ""}
    return {"score": 0.0, "feedback": f"The answer has {len(response)} characters, an even number."}
