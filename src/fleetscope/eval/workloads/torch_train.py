"""A small PyTorch CPU training loop with a known number of steps, for the torch tracer tests/benchmark.

Usage: torch_train.py GO_FILE STEPS [SECONDS_AFTER]. Builds the model, runs
one warm-up step, writes GO_FILE.ready, waits for GO_FILE (so a tracer can
attach first), runs STEPS steps, writes
GO_FILE.done with "steps seconds", then sleeps SECONDS_AFTER (default 30).
STEPS=0 means run until killed, printing steps/s every second to stdout.

Per step, from Python: 2 x linear (nn.Linear), 1 x relu, 1 x matmul,
1 x mse_loss, 1 x backward, and the SGD update: on CPU tensors SGD's
default is the per-parameter loop, 5 x Tensor.add_ (5 parameters).
"""
import os
import sys
import time

import torch
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)
        self.proj = nn.Parameter(torch.randn(64, 16) * 0.1)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return torch.matmul(self.fc2(h), self.proj)


def step(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()


def main():
    go, steps = sys.argv[1], int(sys.argv[2])
    after = float(sys.argv[3]) if len(sys.argv) > 3 else 30
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randn(32, 16)
    step(model, opt, x, y)  # warm-up (lazy init) before the tracer's count starts
    open(go + ".ready", "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    t0 = time.perf_counter()
    if steps == 0:
        n, mark = 0, t0
        while True:
            step(model, opt, x, y)
            n += 1
            now = time.perf_counter()
            if now - mark >= 1.0:
                print(f"{n / (now - mark):.1f}", flush=True)
                n, mark = 0, now
    for _ in range(steps):
        step(model, opt, x, y)
    with open(go + ".done", "w") as f:
        f.write(f"{steps} {time.perf_counter() - t0}")
    time.sleep(after)


if __name__ == "__main__":
    main()
