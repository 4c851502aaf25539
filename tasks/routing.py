"""Which Fairshare job carries a Django task call. A Fairshare job has one queue and is either an
account's work or system work, so each queue a Fairshare `TASKS` backend lists has two jobs:
`tasks.run.<queue>` (an account's calls: admission, budgets, caps, fair share) and
`tasks.system.<queue>` (calls of the backend's SYSTEM_TASKS, which belong to no account)."""


def job_name(*, queue: str, system: bool) -> str:
    return f"tasks.system.{queue}" if system else f"tasks.run.{queue}"
