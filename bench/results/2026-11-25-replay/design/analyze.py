import json, sys, collections
recs=[json.loads(l) for l in open(sys.argv[1])]
t0=recs[0]['t']
def summ(rs,lo,hi):
    rs=[r for r in rs if lo<=r['t']-t0<hi]
    j=[r for r in rs if r['op']=='join']; s=[r for r in rs if r['op']=='step']
    js=sum(r['d'] for r in j); ss=sum(r['d'] for r in s)
    rows=sum(r['rows_before'] for r in s)
    print(f"[{lo},{hi}) joins {len(j)} {js:.2f}s (n/join {sum(r['n'] for r in j)/max(1,len(j)):.1f}, ms/join {1000*js/max(1,len(j)):.0f}) steps {len(s)} {ss:.2f}s ms/step {1000*ss/max(1,len(s)):.0f} rows/step {rows/max(1,len(s)):.1f} tokens {rows} busy {js+ss:.1f}")
for lo in range(0,80,10): summ(recs,lo,lo+10)
summ(recs,0,200)
# step ms by rows
by=collections.defaultdict(list)
for r in recs:
    if r['op']=='step': by[r['rows_before']].append(r['d'])
print({k:(len(v),round(1000*sorted(v)[len(v)//2])) for k,v in sorted(by.items())})
jb=collections.defaultdict(list)
for r in recs:
    if r['op']=='join': jb[(r['n'])].append((r['d'],r['real'],r['width']))
print({k:(len(v),round(1000*sorted(v)[len(v)//2][0]), round(sum(x[1] for x in v)/len(v))) for k,v in sorted(jb.items())})
