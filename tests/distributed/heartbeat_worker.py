"""The worker of tests/distributed/test_heartbeat.py: beats and waits (imports no torch,
so it starts in a moment)."""


def beat_and_wait(heartbeat, conn) -> None:
    heartbeat.start_beating()
    conn.recv()
