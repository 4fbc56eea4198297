"""A training script in the style of the DDP tutorial series' torchrun script (pytorch/examples,
distributed/ddp-tutorial-series/multigpu_torchrun.py), written here: a Trainer that snapshots the
model every few epochs on rank 0 and resumes from the snapshot when restarted.

    torchrun --nproc_per_node 2 tests/client_scripts/ddp_tutorial.py 4 1 --wrap native   # as written
    torchrun --nproc_per_node 2 tests/client_scripts/ddp_tutorial.py 4 1 --wrap ddp      # import changed

Ported to minidist.DataParallel, only the import changes (`--wrap ddp`). ShardedDataParallel
also needs the optimizer in the wrapping line (`--wrap zero1`/`zero2`); at stage 3 the rank-0
`self.model.module.state_dict()` is refused, naming full_state_dict() (every rank).
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group, is_initialized
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from wrappers import device_for, wrap


class RandomClasses(Dataset):
    """Fixed random inputs and labels (the tutorial's MyTrainDataset, with class labels)."""

    def __init__(self, size: int):
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), int(torch.randint(0, 4, (1,), generator=g))) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, how):
        self.local_rank = int(os.environ.get("LOCAL_RANK", torch.distributed.get_rank()))
        self.device = device_for(self.local_rank)
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = wrap(how, self.model, self.optimizer, self.local_rank)  # the one line a port changes

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source.to(self.device), targets.to(self.device))

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)

    def train(self, max_epochs: int):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.local_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    torch.manual_seed(0)
    train_set = RandomClasses(256)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return train_set, model, optimizer


def main(total_epochs: int, save_every: int, how: str, snapshot_path: str, batch_size: int = 16,
         final_state: bool = True) -> dict | None:
    """Train; return this rank's final parameters (for the comparison in tests/test_client_scripts.py)."""
    if not is_initialized():  # under torchrun; the test's rank pool has a process group already
        init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    dataset, model, optimizer = load_train_objs()
    train_data = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path, how)
    trainer.train(total_epochs)
    if not final_state:
        return None
    state = trainer.model.full_state_dict() if how.startswith("zero") else model.state_dict()
    return {k: v.detach().cpu().clone() for k, v in state.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--wrap", default="native", help="native | ddp | zero1 | zero2 | zero3")
    parser.add_argument("--snapshot", default="snapshot.pt")
    parser.add_argument("--out", default=None, help="save the final parameters here (rank 0)")
    args = parser.parse_args()
    final = main(args.total_epochs, args.save_every, args.wrap, args.snapshot)
    if args.out and torch.distributed.get_rank() == 0:
        torch.save(final, args.out)
    destroy_process_group()
