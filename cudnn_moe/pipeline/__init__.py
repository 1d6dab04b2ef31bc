"""What every op's GPU pipeline shares: the one executor cache and the capture-safe release of GPU objects."""

from .lifetime import cached_executor, defer, executor_count, pending_count, release_deferred

__all__ = ["cached_executor", "defer", "executor_count", "pending_count", "release_deferred"]
