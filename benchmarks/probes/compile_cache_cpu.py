import sys, time, os, importlib.util
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from pathlib import Path
import torch
spec = importlib.util.spec_from_file_location("gpu_studies", "benchmarks/gpu_studies.py"); gs = importlib.util.module_from_spec(spec); spec.loader.exec_module(gs)
from sparsefocus.train.driver import GroupTrainer, build_datas
from sparsefocus.train.loop import RunSpec
def main():
    seeds = [1, 2]
    config = gs.study_config("even_pairs", Path("/tmp/cache_exp"), "highest", "none", "default", 1,
                             ("train.device=cpu", "seeds=[1,2]", 'mechanisms=["FULL"]', "task.num_train=200", "task.num_valid=50"))
    specs = [RunSpec(Path("/tmp/cache_exp/unused"), config, "default", "FULL", s) for s in seeds]
    datas = build_datas(config, seeds, torch.device("cpu"))
    tr = GroupTrainer(specs, datas, torch.device("cpu"))
    idx = torch.arange(2 * 25).view(2, 25)
    t = time.perf_counter()
    loss, _, _ = tr.forward(*tr.rows(tr.train_inputs, tr.train_targets, idx))
    loss.backward()
    print("first step (compile) s", round(time.perf_counter() - t, 1), "cache", os.environ.get("TORCHINDUCTOR_CACHE_DIR"))

if __name__ == '__main__':
    main()
