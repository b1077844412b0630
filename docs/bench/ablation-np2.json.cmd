mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 build/dmuon bench ablation --model qwen2.5-0.5b --layers 2 --steps 2 --tune-cache build/bench-tune-1thread.json --json
