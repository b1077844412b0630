mpirun --allow-run-as-root --oversubscribe --bind-to none -np 1 build/dmuon bench optimizer --model qwen2.5-0.5b --layers 4 --steps 3 --tune-cache build/bench-tune-2threads.json --json
