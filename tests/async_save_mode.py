"""The checkpoint tests with every save asynchronous: MEGATRON_FSDP_TEST_ASYNC_SAVE=1 (CI's
async_checkpoints step, scripts/run_tests.sh). Every save_checkpoint of a test then goes through
the asynchronous path (staged copy, DCP's async_save in a background thread, the publish in its
finish step) and waits for its publish before returning, so that the tests, written for the
synchronous save, check the asynchronous one unchanged. Installed by conftest.py in the test
process and by the worker pool in each rank."""

import os

ENV = "MEGATRON_FSDP_TEST_ASYNC_SAVE"


def install_if_asked() -> None:
    if os.environ.get(ENV) != "1":
        return
    from megatron_fsdp.dist_checkpointing import manager

    class AsyncThenWait(manager.CheckpointManager):
        def save(self, *args, **kwargs):
            kwargs["async_save"] = True
            published = super().save(*args, **kwargs)
            assert published is None and self.pending is not None, "the save was not asynchronous"
            return self.finalize(blocking=True)

    manager.set_checkpoint_manager(AsyncThenWait(async_save=True))
