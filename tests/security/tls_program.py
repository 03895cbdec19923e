"""A fibrl program with TLS on, for the test that every listener it opens refuses
plaintext: it holds a Pool, a Manager, a Queue (with a producer process), a
RemoteVectorEnv with local workers, a ``fibrl.channel`` listener and a
``fibrl.rl.PolicyStore``, all in use.

Usage: python tls_program.py [envs] (``envs``: the RemoteVectorEnv only). Prints
"stepped <n>" once the vector env has reset and stepped with TLS, "envs <pid> ..." (the
env workers), "channel <port>" (the channel listener, once a worker used it), "policy
<port>" (the policy store's listener, once a worker read a version), then
"ready <pid> ..." (the manager's server and the pool's workers), so that the test can check
it found them all, and waits for "quit" on stdin.
"""
import os
import sys

import numpy as np

import fibrl
import fibrl.channel
from fibrl.rl import PolicyStore
from fibrl.rl.envs import RemoteVectorEnv


def getpid(_):
    return os.getpid()


def produce(queue):
    queue.put(("made in", os.getpid()))


def ask(address):
    conn = fibrl.channel.connect(address)
    conn.send(fibrl.channel.dumps(("asked by", os.getpid())))
    assert fibrl.channel.loads(conn.recv(timeout=60))[0] == "asked by"
    conn.close()


def read_policy(policy):
    assert policy.latest(timeout=60)[1]["w"].sum() == 1000


def main(everything: bool) -> None:
    fibrl.init(tls=True, backend="local")
    if not everything:
        envs = step_envs()
        print("ready", flush=True)
        sys.stdin.readline()
        envs.close()
        return
    pool = fibrl.Pool(2)
    pool_pids = set(pool.map(getpid, range(8), chunksize=1))
    manager = fibrl.Manager()
    shared = manager.dict(k=1)
    assert shared["k"] == 1
    queue = fibrl.Queue()
    producer = fibrl.Process(target=produce, args=(queue,))
    producer.start()
    assert queue.get(timeout=60)[0] == "made in"
    echo = fibrl.channel.listen(lambda peer, frame: peer.send(frame))
    asker = fibrl.Process(target=ask, args=(echo.address,))
    asker.start()
    asker.join(60)
    assert asker.exitcode == 0, asker.exitcode
    policy = PolicyStore()
    policy.publish({"w": np.ones(1000)})
    reader = fibrl.Process(target=read_policy, args=(policy,))
    reader.start()
    reader.join(60)
    assert reader.exitcode == 0, reader.exitcode
    envs = step_envs()
    print("envs", *[p.pid for p in envs.processes], flush=True)
    print("channel", echo.address.rsplit(":", 1)[1], flush=True)
    print("policy", policy.address.rsplit(":", 1)[1], flush=True)
    print("ready", manager._process.pid, *sorted(pool_pids), flush=True)
    sys.stdin.readline()   # "quit", or EOF when the test is gone
    envs.close()
    echo.close()
    policy.close()
    producer.join(30)
    manager.shutdown()
    pool.terminate()
    pool.join()


def step_envs() -> RemoteVectorEnv:
    """A RemoteVectorEnv of 4 CartPoles in 2 local workers, reset and stepped 5 times."""
    envs = RemoteVectorEnv("CartPole-v1", 4, envs_per_worker=2, seed=3)
    envs.reset(seed=3)
    steps = 0
    for _ in range(5):
        obs, reward, _, _, _ = envs.step(np.zeros(4, dtype=np.int64))
        assert obs.shape == (4, 4) and reward.tolist() == [1.0] * 4
        steps += 1
    print("stepped", steps, flush=True)
    return envs

if __name__ == "__main__":
    main(sys.argv[1:] != ["envs"])
