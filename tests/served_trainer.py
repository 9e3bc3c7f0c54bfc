"""A trainer that dies in the middle of a weight sync to a served engine (tests/test_serve.py runs
it, not collected by pytest):

    python tests/served_trainer.py URL MODEL_DIR after_start|mid_update

after_start: it dies (os._exit, as kill -9 would end it) once the engine's start_weight_update has
returned, before any update; mid_update: once the first of several buckets has arrived, while the
engine's update_weights is still receiving. The engine must take the next run's syncs.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]


def main(url: str, model_dir: str, when: str):
    import torch

    import rollout
    import run
    import sync
    from distributed import Dist
    from policy import load_policy
    d = Dist(0, 1, torch.device("cpu"))
    engine = rollout.ServedEngine(url, model_dir, "float32", rpc_timeout_s=60)
    policy = load_policy(model_dir, run.Config(), 1, d.device)
    transfer = sync.transfer_module()
    if when == "after_start":
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient
        HTTPVLLMWeightSyncClient.update_weights = lambda *args: os._exit(9)
    else:
        real_send = transfer.GlooTrainerWeightTransferEngine._send

        def send_one_then_die(self, part, receiving):
            real_send(self, part, receiving)
            os._exit(9)
        transfer.GlooTrainerWeightTransferEngine._send = send_one_then_die
    engine._transfer_weights(sync.PolicySource(policy, d, torch.float32, bucket_bytes=1 << 20))
    sys.exit("the update ended instead of the trainer")


if __name__ == "__main__":
    main(*sys.argv[1:4])
