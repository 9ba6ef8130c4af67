#!/usr/bin/env python3
"""Makes the seed corpus of the `luks` fuzz target (corpus/luks/): headers
cryptsetup writes with tiny KDF costs, trimmed of trailing zeros (the
target reads past an input as zeros), some edited into what must be
refused, and two that open with the passphrase "pass" (one AF stripe, so
their keyslot area is one sector). Needs root (cryptsetup on a file),
cryptsetup-bin and python3-cryptography; run in a scratch directory.
(luks1-qemu is the first 592 bytes of a `qemu-img create -f luks`.)"""
import subprocess, os, json, hashlib, struct, base64
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
out=os.path.join(os.path.dirname(os.path.abspath(__file__)), 'corpus', 'luks')
os.makedirs(out, exist_ok=True)
open('key','wb').write(b'pass')
def fmt(name, args):
    img=name+'.img'
    with open(img,'wb') as f: f.truncate(17<<20)
    subprocess.run(['cryptsetup','luksFormat','--batch-mode','--key-file','key',*args,img],check=True)
    return open(img,'rb').read()
def trim(b, upto):
    return b[:upto].rstrip(b'\0')
def save(name, b):
    open(os.path.join(out,name),'wb').write(b)
P=['--pbkdf','pbkdf2','--pbkdf-force-iterations','1000']
A=['--pbkdf','argon2id','--pbkdf-memory','32','--pbkdf-force-iterations','4','--pbkdf-parallel','1']
l2=fmt('l2',['--type','luks2','--sector-size','512']+P)
save('luks2-pbkdf2', trim(l2, 16384))
a=fmt('a',['--type','luks2','--key-size','256','--sector-size','4096']+A)
save('luks2-argon2id', trim(a, 16384))
ai=fmt('ai',['--type','luks2','--pbkdf','argon2i','--pbkdf-memory','32','--pbkdf-force-iterations','4','--pbkdf-parallel','2'])
save('luks2-argon2i', trim(ai, 16384))
cbc=fmt('cbc',['--type','luks2','--cipher','aes-cbc-essiv:sha256']+P)
save('luks2-cbc-essiv', trim(cbc, 16384))
l1=fmt('l1',['--type','luks1','--hash','sha1','--key-size','256','--pbkdf-force-iterations','1000'])
save('luks1-sha1', trim(l1, 592))
l1b=fmt('l1b',['--type','luks1','--pbkdf-force-iterations','1000'])
save('luks1-sha256', trim(l1b, 592))
# Damaged copies: primary checksum broken (the secondary opens), magic gone.
b=bytearray(trim(l2,32768)); b[5000]^=1; save('luks2-bad-primary', bytes(b))
b=bytearray(trim(l2,32768)); b[0:6]=b'\0'*6; save('luks2-no-primary', bytes(b))
save('luks2-truncated', l2[:10000])
save('luks-v3', b'LUKS\xba\xbe\x00\x03' + b'\0'*100)
save('not-luks', b'QFI\xfb not a LUKS image\n')
# JSON edits, both copies, checksums fixed.
def edit(img, f, keep=32768):
    b=bytearray(img[:max(keep,32768)])
    hs=struct.unpack('>Q', b[8:16])[0]
    for at in (0, hs):
        area=b[at+4096:at+hs]; end=area.index(0)
        j=json.loads(area[:end]); f(j)
        t=json.dumps(j,separators=(',',':')).encode()
        assert len(t)<hs-4096
        b[at+4096:at+hs]=t+b'\0'*(hs-4096-len(t))
        b[at+448:at+512]=b'\0'*64
        b[at+448:at+480]=hashlib.sha256(bytes(b[at:at+hs])).digest()
    return bytes(b)
def costly(j): j['keyslots']['0']['kdf']['iterations']=4000000000
save('luks2-too-costly', trim(edit(l2,costly),16384))
def mem(j): j['keyslots']['0']['kdf']={'type':'argon2id','time':4,'memory':8388608,'cpus':1,'salt':'AAAAAAAAAAAAAAAAAAAAAA=='}
save('luks2-argon2-memory', trim(edit(l2,mem),16384))
def integ(j): j['segments']['0']['integrity']={'type':'hmac(sha256)','journal_encryption':'none','journal_integrity':'none'}
save('luks2-integrity', trim(edit(l2,integ),16384))
def overlap(j):
    k=dict(j['keyslots']['0']); k['area']=dict(k['area']); k['area']['offset']='163840'; j['keyslots']['1']=k
    j['digests']['0']['keyslots']=['0','1']
save('luks2-overlap', trim(edit(l2,overlap),16384))
def reenc(j): j['config']['requirements']={'mandatory':['online-reencrypt-v2']}
save('luks2-reencrypt', trim(edit(l2,reenc),16384))
def pbkdf2(pw, salt, it, n, h='sha256'): return hashlib.pbkdf2_hmac(h, pw, salt, it, n)
def xts_enc(key, data):
    out=b''
    for i in range(0,len(data),512):
        tweak=struct.pack('<Q',i//512)+b'\0'*8
        e=Cipher(algorithms.AES(key), modes.XTS(tweak)).encryptor()
        out+=e.update(data[i:i+512])+e.finalize()
    return out
# Openable with "pass": one stripe, so the keyslot area is one sector.
vk=bytes(range(32))
def tiny2(j):
    ks=j['keyslots']['0']; ks['key_size']=32; ks['af']['stripes']=1
    ks['area']['key_size']=32; ks['area']['size']='4096'
    salt=b'S'*32; ks['kdf']={'type':'pbkdf2','hash':'sha256','iterations':1000,'salt':base64.b64encode(salt).decode()}
    d=j['digests']['0']; dsalt=b'D'*32
    d['salt']=base64.b64encode(dsalt).decode(); d['iterations']=1000
    d['digest']=base64.b64encode(pbkdf2(vk,dsalt,1000,32)).decode()
t=bytearray(edit(l2,tiny2))
salt=b'S'*32
area=xts_enc(pbkdf2(b'pass',salt,1000,32), vk+b'\0'*480)
t=bytes(t).rstrip(b'\0')
t=t+b'\0'*(32768-len(t))+area
save('luks2-opens', t)
# LUKS1, one stripe, key material at sector 2, payload at sector 4.
h=bytearray(l1b[:592])
h[108:112]=struct.pack('>I',32)
mks=b'M'*32
h[112:132]=pbkdf2(vk,mks,1000,20); h[132:164]=mks; h[164:168]=struct.pack('>I',1000)
h[104:108]=struct.pack('>I',4)
s0=208; ss=b'K'*32
h[s0:s0+4]=struct.pack('>I',0x00AC71F3); h[s0+4:s0+8]=struct.pack('>I',1000); h[s0+8:s0+40]=ss
h[s0+40:s0+44]=struct.pack('>I',2); h[s0+44:s0+48]=struct.pack('>I',1)
for i in range(1,8):
    o=s0+48*i; h[o:o+4]=struct.pack('>I',0xDEAD)
area=xts_enc(pbkdf2(b'pass',ss,1000,32), vk+b'\0'*480)
save('luks1-opens', bytes(h)+b'\0'*(1024-592)+area)
