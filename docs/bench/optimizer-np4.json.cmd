mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 build/dmuon bench optimizer --model qwen2.5-0.5b --layers 4 --steps 2 --tune-cache build/bench-tune-1thread.json --json
