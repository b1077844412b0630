mpirun --allow-run-as-root --oversubscribe --bind-to none -np 1 build/dmuon bench e2e --config demo --steps 8 --tune-cache build/bench-tune-2threads.json --json
