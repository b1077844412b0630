mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 build/dmuon bench e2e --config demo --batch 128 --optim adamw,dmuon --steps 6 --tune-cache build/bench-tune-1thread.json --json
